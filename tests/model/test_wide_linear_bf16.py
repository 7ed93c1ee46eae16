"""bf16 activations on the packed layout (``csrc/wide_packed_bf16.h``: vdpbf16ps where the build
has AVX512-BF16, else the float32 kernel on widened x): exact on sums float32 holds exactly, within
one rounding on random values, a row's bits whatever its batch, bad input refused; which CPUs
pick it for a bf16 model (``bf16_kernel_linears``), and such a model's logits and tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.config import CpuLinearKernel
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model
from kvserve.model.wide_linear import WideLinear, bf16_kernel_linears, pack_wide_weight
from kvserve.ops import cpu_kernels
from kvserve.ops.packed_linear import PackedLinear, packing_supported
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model, random_prompts, run_engine_checked

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def native_bf16() -> bool:
    """Whether this build multiplies bf16 with vdpbf16ps (else: widened to float32)."""
    return str(torch.ops.kvserve.wide_linear_bf16_isa()) == "avx512bf16"


def row_counts() -> list[int]:
    """1-6 rows (every tile height), groups of 6 with each tail, and past direct_rows (the
    vdpbf16ps build takes every row count; the widened one hands those to at::linear)."""
    direct = int(torch.ops.kvserve.wide_linear_direct_rows())
    return [1, 2, 3, 4, 5, 6, 7, 11, 16, 40, direct, direct + 1]


# channel tails (16-channel strips, 64-channel panels), odd K (the last k pairs with a zero)
# and K past one 256-k chunk
SHAPES = [(13, 64), (64, 131), (70, 300), (130, 513)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_exact_where_float32_sums_are_exact(n: int, k: int) -> None:
    """Small integers: every partial sum is exact in float32 whatever the order, so the one
    rounding to bf16 must give the exact product rounded, bit for bit."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(-4, 5, (n, k), generator=g).to(BF16)
    bias = torch.randint(-50, 51, (n,), generator=g).float()
    packed = pack_wide_weight(w)
    for rows in row_counts():
        x = torch.randint(-4, 5, (rows, k), generator=g).to(BF16)
        want = (x.double() @ w.double().t() + bias.double()).to(BF16)
        got = torch.ops.kvserve.wide_linear_packed(x, packed, bias, n)
        assert got.dtype == BF16 and got.shape == (rows, n)
        assert torch.equal(got, want), rows
        no_bias = torch.ops.kvserve.wide_linear_packed(x, packed, None, n)
        assert torch.equal(no_bias, (x.double() @ w.double().t()).to(BF16)), rows


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_random_values_within_one_rounding(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(7 * n + k)
    w = torch.randn(n, k, generator=g).to(BF16)
    bias = torch.randn(n, generator=g)
    packed = pack_wide_weight(w)
    for rows in row_counts():
        x = torch.randn(rows, k, generator=g).to(BF16)
        exact = x.double() @ w.double().t() + bias.double()
        got = torch.ops.kvserve.wide_linear_packed(x, packed, bias, n).double()
        # one bf16 rounding (half an ulp: 2^-9 relative) of a float32 sum (a few float32 ulps
        # of the largest partial sum)
        f32 = 4 * k * 2.0**-24 * float((x.double().abs() @ w.double().abs().t()).max())
        err = (got - exact).abs() - 2.0**-8 * exact.abs()
        assert float(err.max()) <= f32 + 1e-6, rows


def test_a_row_does_not_depend_on_its_batch() -> None:
    """One chain along K per output whatever the tile: a row's bits are the same alone, in any
    batch and at any row count (the vdpbf16ps build; the widened one up to direct_rows)."""
    g = torch.Generator().manual_seed(5)
    n, k = 70, 515
    packed = pack_wide_weight(torch.randn(n, k, generator=g).to(BF16))
    top = 300 if native_bf16() else int(torch.ops.kvserve.wide_linear_direct_rows())
    x = torch.randn(top, k, generator=g).to(BF16)
    big = torch.ops.kvserve.wide_linear_packed(x, packed, None, n)
    for rows in (1, 2, 3, 5, 6, 7, 13, 25):
        part = torch.ops.kvserve.wide_linear_packed(x[9 : 9 + rows], packed, None, n)
        assert torch.equal(part, big[9 : 9 + rows]), rows


def test_bad_input_raises() -> None:
    op = torch.ops.kvserve.wide_linear_packed
    packed = pack_wide_weight(torch.zeros(20, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="bfloat16 x needs bfloat16 weights"):
        op(torch.zeros(1, 32, dtype=BF16), packed, None, 20)
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16"):
        op(torch.zeros(1, 32, dtype=torch.float16), packed, None, 20)


AUTO, ONEDNN, PACKED = CpuLinearKernel.AUTO, CpuLinearKernel.ONEDNN, CpuLinearKernel.PACKED
KW = {"native": True, "quantized": False, "tp": 1}


def auto_picks_it() -> bool:
    return bf16_kernel_linears(AUTO, BF16, CPU, **KW)  # type: ignore[arg-type]


def test_which_cpus_pick_it(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = KW
    assert auto_picks_it() == (native_bf16() and "amx_bf16" not in cpu_kernels.cpu_flags())
    assert bf16_kernel_linears(PACKED, BF16, CPU, **kw)  # type: ignore[arg-type]
    assert not bf16_kernel_linears(ONEDNN, BF16, CPU, **kw)  # type: ignore[arg-type]
    refused = [
        ((torch.float32, CPU, kw), "for bfloat16 models"),
        ((BF16, torch.device("meta"), kw), "it is a CPU path"),
        ((BF16, CPU, {**kw, "native": False}), "not the transformers backend"),
        ((BF16, CPU, {**kw, "quantized": True}), "quantized linears keep"),
        ((BF16, CPU, {**kw, "tp": 2}), "tensor_parallel_size 1"),
    ]
    for (dtype, dev, k), msg in refused:
        assert not bf16_kernel_linears(AUTO, dtype, dev, **k)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"cpu_linear_kernel packed: .*{msg}"):
            bf16_kernel_linears(PACKED, dtype, dev, **k)  # type: ignore[arg-type]
    # AMX: oneDNN's tiles keep the linears under auto (not measured against this kernel)
    amx = cpu_kernels.cpu_flags() | {"amx_bf16", "amx_tile"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: amx)
    assert not auto_picks_it()
    assert bf16_kernel_linears(PACKED, BF16, CPU, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bf16")
    make_tiny_model("llama", path).to(BF16).save_pretrained(path)
    return path


def onednn_layers() -> int:
    """The layers oneDNN packs where the packed kernel is not picked: all 9, or none on CPUs
    whose oneDNN cannot pack bf16 (AVX2-only: nn.Linear stays)."""
    return 9 if packing_supported(CPU, BF16) else 0


def onednn_path() -> str:
    return "onednn" if onednn_layers() else "aten"


def kinds(model: nn.Module) -> tuple[int, int]:
    mods = list(model.modules())
    return (sum(isinstance(m, WideLinear) for m in mods),
            sum(isinstance(m, PackedLinear) for m in mods))  # fmt: skip


def test_bf16_model_logits(checkpoint: Path) -> None:
    """The loaded bf16 model: its linears on this CPU's pick (9: 2 layers x 4 and the head),
    the logits of a prompt within bf16 rounding of the plain nn.Linear model's."""
    model = load_model(checkpoint, BF16, CPU, 64, prepack=True, fused_ops=True)
    assert kinds(model) == ((9, 0) if auto_picks_it() else (0, onednn_layers()))
    plain = load_model(checkpoint, BF16, CPU, 64)  # no prepacking: nn.Linear
    assert kinds(plain) == (0, 0)
    forced = load_model(checkpoint, BF16, CPU, 64, prepack=True, linear_kernel="packed")
    assert kinds(forced) == (9, 0)
    onednn = load_model(checkpoint, BF16, CPU, 64, prepack=True, linear_kernel="onednn")
    assert kinds(onednn) == (0, onednn_layers())
    x = torch.randn(5, model.lm_head.in_features).to(BF16)
    with torch.no_grad():
        want = plain.lm_head(x).float()
        for m in (forced, onednn):
            got = m.lm_head(x)
            assert got.dtype == BF16 and got.shape == want.shape
            tol = 2**-7 * float(want.abs().max())
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=tol)


PROMPTS = random_prompts([3, 7, 12, 5, 20, 9])
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(path: Path, **kw: object) -> tuple[list[list[int]], LLMEngine]:
    e = LLMEngine(build_engine_config(str(path), dtype="bfloat16", block_size=4,
                                      num_kv_blocks=120, **kw))  # fmt: skip
    done = run_engine_checked(e, PROMPTS, PARAMS)
    return [done[str(i)] for i in range(len(PROMPTS))], e


def test_engine_tokens_with_the_loop_and_without(checkpoint: Path) -> None:
    """The engine's pick: the C++ decode loop and the Python layers give the same tokens and
    KV bytes; the execution paths name the linears' kernel."""
    eager, e1 = run(checkpoint, enforce_eager=True)
    looped, e2 = run(checkpoint)
    assert e1.runner is not None and e2.runner is not None
    assert e2.runner.model.decode_loop is not None and e2.runner.model.decode_loop.steps > 0
    assert looped == eager and all(len(t) == 16 for t in looped)
    for a, b in zip(e1.runner.kv_caches, e2.runner.kv_caches, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert e2.execution_paths.linears == ("packed-bf16" if auto_picks_it() else onednn_path())
    _, e3 = run(checkpoint, cpu_linear_kernel="onednn")
    assert e3.execution_paths.linears == onednn_path()
