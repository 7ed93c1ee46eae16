"""``csrc/wide_linear.cpp`` built for a forced instruction set, whatever the CPU at hand picks:
its AVX2 path (what AVX2-only CPUs run; an AVX-512 build would take it too), its scalar path
(CPUs without AVX2/FMA/F16C) and its AVX512-BF16 path for bf16 activations, each built alone
under its own op namespace and held to the reference on the [N, K] weights and on the packed
ones (the one layout every build reads), so that CI tests every variant on any CPU kind that
can run it. bf16 activations: the vdpbf16ps kernel, or the others' widened float32 path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model.wide_linear import pack_wide_weight, reference_wide_linear

SOURCE = Path(__file__).resolve().parents[2] / "kvserve" / "csrc" / "wide_linear.cpp"
VARIANTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],
    "scalar": ["-mno-avx2", "-mno-fma", "-mno-f16c"],
    "avx512bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512bf16"],
}
NEEDS = {"avx2": {"avx2", "fma", "f16c"},
         "avx512bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}}  # fmt: skip


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
    if not NEEDS.get(isa, set()) <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(NEEDS[isa] - cpu_flags())} to run the {isa} build")
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
    assert ops.wide_linear_isa() == ("scalar" if isa == "scalar" else "avx2")
    assert ops.wide_linear_bf16_isa() == ("avx512bf16" if isa == "avx512bf16" else "float32")
    assert int(ops.wide_linear_panel_rows()) == (0 if isa == "scalar" else 24)
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
    # bf16 activations: small integers, so every float32 partial sum is exact and the one
    # rounding gives the exact product rounded, bit for bit (odd K: the zero-paired last k)
    for n, k in ((13, 64), (40, 131), (70, 513)):
        w = torch.randint(-4, 5, (n, k), generator=g).bfloat16()
        bias = torch.randint(-9, 10, (n,), generator=g).float()
        for rows in (1, 2, 3, 4, 5, 6, 7, 25, 300):
            x = torch.randint(-4, 5, (rows, k), generator=g).bfloat16()
            got = ops.wide_linear_packed(x, pack_wide_weight(w), bias, n)
            want = (x.double() @ w.double().t() + bias.double()).bfloat16()
            assert torch.equal(got, want), (n, k, rows, "bf16")
