"""``$KVSERVE_CPU_ISA``: the kernels built for a fixed instruction set (issue 31).

So that one CI machine tests both kinds' code: an AVX-512 machine builds and runs the AVX2
variant (``avx2``), and a machine with AVX-512 BF16 and VNNI builds the ``avx512`` one whatever
its native default. A forced variant the CPU cannot execute is refused with the missing flags
named. The builds run in subprocesses (the environment variable is read once per process), in
the usual ``$TORCH_EXTENSIONS_DIR``, so a second run loads the cached library. Where this
CPU's own build compiles the very code of a forced one (the AVX2 one on an AVX2-only CPU, the
AVX-512 one on an AVX512-BF16 EPYC), the check runs on the own build instead of compiling the
same code a second time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels
from kvserve.ops.cpu_kernels import ISA_ENV, CpuIsa

FLAGS = cpu_kernels.cpu_flags()
BUILD_TIMEOUT = 900  # s: a cold build of every kernel took 272 s on a busy 2-core machine

# Run by the forced builds: the kernels load, are the variant asked for, the quantized
# kernel's float32 paths (one row: direct; 7 and 64 rows: tiles) equal the reference,
# float32 int8 activations (the AVX2 vpmaddubsw path in both builds) equal theirs, and the
# LoRA kernel (its AVX2 or AVX-512 path; bf16 by vdpbf16ps in the AVX-512 build) equals its
# reference in float32 and bf16 with row and channel tails; table codes equal the same codes
# as bytes on the weight-only kernel (float32 and bf16) and, on VNNI, the int8 one (bf16).
CHECK = """
import sys
import torch
from kvserve.ops import cpu_kernels
from kvserve.config import QuantizedActivations
from kvserve.quantization.qlinear import QuantLinear, reference_linear, reference_linear_a8
from kvserve.quantization.qweight import quantize_rtn

assert cpu_kernels.available(), "kernels did not build"
print(cpu_kernels.kernel_build_spec().name, torch.ops.kvserve.quant_linear_f32_isa(),
      torch.ops.kvserve.quant_linear_bf16_native(), torch.ops.kvserve.quant_linear_a8_supported(),
      torch.ops.kvserve.quant_linear_a8_isa(), torch.ops.kvserve.lora_isa())
cpu = torch.device("cpu")
g = torch.Generator().manual_seed(0)
for bits, group, sym in ((8, 32, None), (8, None, None), (4, 32, True), (4, 128, None)):
    qw = quantize_rtn(torch.randn(80, 384, generator=g), bits, group, sym)
    layer = QuantLinear(qw, None, cpu, torch.float32)
    assert layer.use_kernel
    for rows in (1, 7, 64):
        x = torch.randn(rows, 384, generator=g)
        ref = reference_linear(x.double(), qw).float()
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    a8 = QuantLinear(qw, None, cpu, torch.float32, QuantizedActivations.INT8)
    assert a8.path == "a8"
    for rows in (1, 4, 7):
        x = torch.randn(rows, 384, generator=g)
        ref = reference_linear_a8(x.double(), qw).float()
        torch.testing.assert_close(a8(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
from kvserve.quantization.a8_table import A8_TABLE, TABLE_OFFSET, a8_table
from kvserve.quantization.qlinear import A8Scales, pack_a8, pack_codes
from kvserve.quantization.qweight import QuantizedWeight
levels = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
codes = levels[torch.randint(0, 15, (80, 384), generator=g)]  # MXFP4's values
scales = torch.exp2(torch.randint(-9, -3, (80, 12), generator=g).float())
qw = QuantizedWeight(codes, scales, None, 8, 32)
packed, _ = pack_codes(codes, 8)
for dtype in (torch.float32, torch.bfloat16):  # weight-only table codes equal byte codes
    layer = QuantLinear(qw, None, cpu, dtype)
    assert layer.offset == TABLE_OFFSET
    for rows in (1, 7, 64):
        x = torch.randn(rows, 384, generator=g).to(dtype)
        want = torch.empty(rows, 80, dtype=dtype)
        torch.ops.kvserve.quant_linear(want, x, packed, layer.scales_t, layer.zeros_t, 8, 32, 0,
                                       layer.direct_rows)
        assert torch.equal(layer(x).view(torch.uint8), want.view(torch.uint8))
if torch.ops.kvserve.quant_linear_a8_supported():  # bf16 on VNNI: table codes (the forced
    # AVX-512 build has no VBMI, so its vpshufb lookup) equal byte codes
    layer = QuantLinear(qw, None, cpu, torch.bfloat16, QuantizedActivations.INT8)
    assert layer.scale_format & A8_TABLE
    table = a8_table(qw)
    packed, off = pack_a8(qw, A8Scales.FLOAT16, 8, off=table.offset)
    for rows in (1, 4, 20):
        x = torch.randn(rows, 384, generator=g).bfloat16()
        want = torch.empty(rows, 80, dtype=torch.bfloat16)
        torch.ops.kvserve.quant_linear_a8(want, x, packed, 8, 32, off, 1, False)
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))
from kvserve.lora.punica import lora_delta_reference
slots = torch.tensor([0, 2, -1, 1, 0, 2, 2, 1, 0])  # 3 adapters and a base row
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
    x = torch.randn(9, 83, generator=g).to(dtype)  # K = 83: a masked / scalar tail
    a = (torch.randn(3, 2 * 16, 83, generator=g) * 0.1).to(dtype)
    bts = [(torch.randn(3, 16, n, generator=g) * 0.1).to(dtype) for n in (70, 9)]
    out = torch.zeros(9, 79, dtype=dtype)
    cpu_kernels.lora_add(out, x, a, bts, slots)
    ref = lora_delta_reference(x.double(), a.double(), [b.double() for b in bts], slots)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
from tests.lora.test_punica import integer_case  # exact sums: only the bf16 store rounds
x, a, bts, slots, base = integer_case(0)
out = base.clone()
cpu_kernels.lora_add(out, x, a, bts, slots)
want = (base.float() + lora_delta_reference(x.double(), a.double(), [b.double() for b in bts],
                                            slots).float()).bfloat16()
keep = ~torch.isnan(want)
assert torch.equal(torch.isnan(out), ~keep)
assert torch.equal(out[keep].view(torch.int16), want[keep].view(torch.int16))
print("equal")
"""


def run_forced(isa: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ISA_ENV: isa, "KVSERVE_KERNEL_BUILD_TIMEOUT": str(BUILD_TIMEOUT)}
    env.pop("KVSERVE_DISABLE_CPU_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=BUILD_TIMEOUT + 120,
    )  # fmt: skip


def preprocessed(cflags: tuple[str, ...], source: Path) -> list[str]:
    """``source`` after the preprocessor, as the build compiles it, less the compiler's own
    intrinsic headers: those wrap the intrinsics of the extensions ``-march`` leaves out in
    ``#pragma GCC target`` lines, which change no code built from the sources."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cxx = os.environ.get("CXX", "c++")
    own = subprocess.run([cxx, "-print-file-name=include"], capture_output=True, text=True)
    out = subprocess.run(
        [cxx, "-E", "-std=c++20", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H",
         *(f"-isystem{p}" for p in includes), *cflags, str(source)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    skip, kept = False, []
    for line in out.stdout.splitlines():
        if line.startswith("# "):  # a line marker: # <line> "<file>" <flags>
            skip = line.split('"')[1].startswith(own.stdout.strip() + "/")
        elif not skip:
            kept.append(line)
    return kept


def same_code_as_native(isa: CpuIsa, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether this CPU's own build compiles exactly the forced ``isa`` build's code: the same
    sources after the preprocessor (so the same ``CPU_CAPABILITY``, the same ``#if __AVX2__``
    paths). Then only ``-march``/``-mtune`` differ (here ``native`` on an AVX2-only EPYC
    against ``x86-64-v3``: instruction scheduling and extensions no source uses, such as SHA
    and VAES), and the native build, already built, runs the forced build's code paths."""
    monkeypatch.delenv(ISA_ENV, raising=False)
    native = cpu_kernels.kernel_build_spec()
    monkeypatch.setenv(ISA_ENV, isa.value)
    forced = cpu_kernels.kernel_build_spec()
    monkeypatch.delenv(ISA_ENV)
    if native.sources != forced.sources:
        return False
    jobs = [(spec.cflags, src) for src in forced.sources for spec in (native, forced)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # 16 runs: 24 s one by one, loaded
        texts = list(pool.map(lambda job: preprocessed(*job), jobs))
    return texts[0::2] == texts[1::2]


def test_the_isa_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert cpu_kernels.requested_isa() is CpuIsa.NATIVE
    monkeypatch.setenv(ISA_ENV, " AVX2 ")
    assert cpu_kernels.requested_isa() is CpuIsa.AVX2
    monkeypatch.setenv(ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"^\$KVSERVE_CPU_ISA must be one of native, avx2, "):
        cpu_kernels.requested_isa()


def test_a_forced_isa_builds_its_own_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "avx2")
    if cpu_kernels.missing_flags(CpuIsa.AVX2, FLAGS):
        with pytest.raises(RuntimeError, match=r"KVSERVE_CPU_ISA=avx2: this CPU lacks "):
            cpu_kernels.kernel_build_spec()
        return
    spec = cpu_kernels.kernel_build_spec()
    assert spec.name == "kvserve_cpu_kernels_isa_avx2"
    assert "-march=x86-64-v3" in spec.cflags and "-march=native" not in spec.cflags
    assert not any("AVX512" in f for f in spec.cflags)
    monkeypatch.setenv(ISA_ENV, "native")
    assert cpu_kernels.kernel_build_spec().digest != spec.digest  # another cache folder


def test_missing_flags_names_what_the_cpu_lacks() -> None:
    zen3 = frozenset(["avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"])
    assert cpu_kernels.missing_flags(CpuIsa.AVX2, zen3) == []
    assert cpu_kernels.missing_flags(CpuIsa.NATIVE, frozenset()) == []
    lacks = cpu_kernels.missing_flags(CpuIsa.AVX512, zen3 | {"avx512f", "avx512bw"})
    assert lacks == ["avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"]


@pytest.mark.slow  # builds every kernel once (minutes), then loads the cached build
@pytest.mark.skipif(
    bool(cpu_kernels.missing_flags(CpuIsa.AVX2, FLAGS)),
    reason="this CPU lacks AVX2 (or FMA, F16C, BMI): it cannot run the AVX2 build",
)
def test_the_avx2_build_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # On an AVX2-only CPU whose own build compiles the same code, that build (already built
    # by the other kernel tests) is the one checked: a cold forced build took 203 s of a
    # 1489 s suite run on the 2-core CI machine. Elsewhere (AVX-512, AMX) the forced one is.
    native = same_code_as_native(CpuIsa.AVX2, monkeypatch)
    out = run_forced("native" if native else "avx2", CHECK)
    assert out.returncode == 0, out.stderr[-3000:]
    # no AVX-512 path in it, whatever this CPU has: bf16 activations widened, no int8 ones
    name = "kvserve_cpu_kernels_avx2" if native else "kvserve_cpu_kernels_isa_avx2"
    assert out.stdout.splitlines() == [f"{name} avx2 False False avx2 avx2", "equal"]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(cpu_kernels.missing_flags(CpuIsa.AVX512, FLAGS)),
    reason="this CPU lacks "
    + ", ".join(cpu_kernels.missing_flags(CpuIsa.AVX512, FLAGS))
    + ": it cannot run the AVX-512 build",
)
def test_the_avx512_build_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the AVX2 check on an AVX2-only CPU: on an AVX512-BF16 EPYC (Zen 5 kind) the native
    # build compiles the same code, and the forced one took 129 s of a 770 s suite run.
    native = same_code_as_native(CpuIsa.AVX512, monkeypatch)
    out = run_forced("native" if native else "avx512", CHECK)
    assert out.returncode == 0, out.stderr[-3000:]
    name = "kvserve_cpu_kernels_avx512" if native else "kvserve_cpu_kernels_isa_avx512"
    assert out.stdout.splitlines() == [f"{name} avx2 True True avx2 avx512bf16", "equal"]


@pytest.mark.skipif(
    not cpu_kernels.missing_flags(CpuIsa.AVX512, FLAGS), reason="this CPU has AVX-512"
)
def test_an_isa_the_cpu_lacks_falls_back_with_a_warning() -> None:
    code = "from kvserve.ops import cpu_kernels; print(cpu_kernels.available())"
    out = run_forced("avx512", code)
    assert out.returncode == 0 and out.stdout == "False\n", out.stderr
    lacks = ", ".join(cpu_kernels.missing_flags(CpuIsa.AVX512, FLAGS))
    why = RuntimeError(
        f"${ISA_ENV}=avx512: this CPU lacks {lacks} (unset it to build for this CPU's own "
        "instruction set)"
    )
    want = f"CPU kernels unavailable, using the PyTorch paths: {why!r}"
    assert want in out.stderr, out.stderr
