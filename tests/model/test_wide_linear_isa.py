"""``csrc/wide_linear.cpp`` built for a forced instruction set, whatever the CPU at hand picks:
its AVX2 path (what AVX2-only CPUs run; an AVX-512 build would take it too) and its scalar
path (CPUs without AVX2/FMA/F16C), each built alone under its own op namespace and held to the
reference on the [N, K] weights and on the packed ones (the one layout every build reads), so
that CI tests both variants on any CPU kind that can run them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model.wide_linear import pack_wide_weight, reference_wide_linear

SOURCE = Path(__file__).resolve().parents[2] / "kvserve" / "csrc" / "wide_linear.cpp"
VARIANTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],
    "scalar": ["-mno-avx2", "-mno-fma", "-mno-f16c"],
}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_dir(ns: str) -> Path:
    """A folder under torch's extension folder (``$TORCH_EXTENSIONS_DIR``), kept across runs
    as tests/ops/test_cpu_isa.py's forced builds are: ninja rebuilds when the source or the
    flags change and otherwise the run loads the library it built before. (A fresh tmp_path
    per run cost two cold compiles, 24-31 s each on the shared 2-core box, every run.)"""
    from torch.utils import cpp_extension

    path = Path(cpp_extension._get_build_directory(ns, verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.slow  # one compile of one file per variant, ~20 s each (cached after)
@pytest.mark.parametrize("isa", list(VARIANTS))
def test_forced_isa_build_equals_reference(isa: str) -> None:
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C to run the AVX2 build")
    from torch.utils import cpp_extension

    ns = f"kvserve_wide_{isa}"
    cpp_extension.load(
        name=ns, sources=[str(SOURCE)], build_directory=str(build_dir(ns)),
        is_python_module=False,
        extra_cflags=["-O2", "-fopenmp", "-ffp-contract=off", f"-DKVSERVE_NS={ns}",
                      *VARIANTS[isa]],
        extra_ldflags=["-fopenmp"], verbose=False,
    )  # fmt: skip
    ops = getattr(torch.ops, ns)
    assert ops.wide_linear_isa() == isa
    assert int(ops.wide_linear_panel_rows()) == (24 if isa == "avx2" else 0)
    g = torch.Generator().manual_seed(7)
    for wdtype in (torch.bfloat16, torch.float16):
        for n, k in ((13, 64), (40, 131), (70, 300)):
            w = torch.randn(n, k, generator=g).to(wdtype)
            packed = pack_wide_weight(w)
            bias = torch.randn(n, generator=g)
            # the [N, K] path's panels from wide_linear_panel_rows() rows (0: the scalar build
            # has none); the packed path's tiles of 1-6 rows and groups of 6
            for rows in (1, 2, 3, 4, 5, 25, 40, int(ops.wide_linear_direct_rows())):
                x = torch.randn(rows, k, generator=g)
                want = reference_wide_linear(x.double(), w, bias.double())
                tol = 4 * k * 2.0**-24 * float((x.abs() @ w.float().abs().t()).max()) + 1e-6
                got = ops.wide_linear(x, w, bias).double()
                assert float((got - want).abs().max()) <= tol, (wdtype, n, k, rows)
                got = ops.wide_linear_packed(x, packed, bias, n).double()
                assert float((got - want).abs().max()) <= tol, (wdtype, n, k, rows, "packed")
                # batch-invariant mode's setting: the same bits for a row alone
                whole = ops.wide_linear_packed(x, packed, bias, n, 0)
                assert torch.equal(ops.wide_linear_packed(x[-1:], packed, bias, n, 0), whole[-1:])
