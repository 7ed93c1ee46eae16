"""16-bit stored weights computed in float32 (``kvserve/model/wide_linear.py``): the packed
layout and back; the C++ kernel (packed, and the [N, K] path on both sides of its panel-rows
threshold) against ``F.linear`` of the widened weights, below and above direct_rows; a row's
result whatever the other rows and (packed) whatever their number;
what ``weight_dtype`` auto picks; refusals; the engine's tokens and KV bytes with the widened
layers against the same weights held in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model
from kvserve.model.wide_linear import (
    WideLinear,
    pack_wide_weight,
    reference_wide_linear,
    resolve_weight_dtype,
    unpack_wide_weight,
    widen_linears,
)
from kvserve.ops import cpu_kernels
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

CPU = torch.device("cpu")


def direct_rows() -> int:
    return int(torch.ops.kvserve.wide_linear_direct_rows())


def packed_direct_rows() -> int:
    return int(torch.ops.kvserve.wide_linear_packed_direct_rows())


def panel_rows() -> int:
    """The fewest rows that take the [N, K] path's per-call panels (0: this build has none)."""
    return int(torch.ops.kvserve.wide_linear_panel_rows())


NEVER = 2**62  # panel_rows no batch reaches: the [N, K] path's loop for every row count


def tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """float32 sums of K products in another order: a few ulps of the largest partial sum."""
    return 4 * x.shape[1] * 2.0**-24 * float((x.abs() @ w.float().abs().t()).max()) + 1e-6


# channel and K tails: of the 16-channel strips, the 64-channel panels (and the unpacked
# path's 4-channel blocks), the 8-wide vectors and the 256-K chunks
SHAPES = [(13, 64), (64, 131), (96, 2048), (70, 300), (130, 520)]


def test_pack_layout_and_back() -> None:
    w = torch.randn(37, 20).bfloat16()
    packed = pack_wide_weight(w)  # [3, 20, 16]
    assert packed.shape == (3, 20, 16) and packed.is_contiguous()
    assert torch.equal(packed[2, 5, 3], w[35, 5]) and torch.equal(packed[1, 19, 0], w[16, 19])
    assert not packed[2, :, 5:].any()  # channels 37..47: zeros
    assert torch.equal(unpack_wide_weight(packed, 37), w)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_reference(wdtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    """The packed kernel (every tile shape: 1-6 rows and groups of 6) and the widened copy
    above direct_rows, against the reference on the [N, K] weight."""
    g = torch.Generator().manual_seed(n * k)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))  # type: ignore[union-attr]
    layer = WideLinear(lin, wdtype)
    w = layer.unpacked_weight()
    assert layer.weight_dtype == wdtype and w.shape == (n, k)
    assert torch.equal(w, lin.weight.detach().to(wdtype))
    top = packed_direct_rows()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 23, 40, direct_rows() + 1, top, top + 1):
        x = torch.randn(rows, k, generator=g)
        got = layer(x)
        want = reference_wide_linear(x.double(), w.double(), None)  # exact sums
        if bias:
            want = want + layer.bias.double()  # type: ignore[union-attr]
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert float((got.double() - want).abs().max()) <= tolerance(x, w), rows
    assert layer(torch.randn(2, 3, k)).shape == (2, 3, n)  # leading dims


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES[::2])
def test_unpacked_kernel_equals_reference(wdtype: torch.dtype, n: int, k: int) -> None:
    """The [N, K] path (batch-invariant mode's plain layers, float32 weights too): the
    weight-stationary loop and the panels widened per call, both sides of panel_rows."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(wdtype)
    bias = torch.randn(n, generator=g)
    p = max(panel_rows(), 2)
    for rows, panels in [(1, -1), (5, -1), (p - 1, -1), (p, -1), (p + 7, -1), (40, NEVER)]:
        x = torch.randn(rows, k, generator=g)
        got = torch.ops.kvserve.wide_linear(x, w, bias, -1, panels)
        want = reference_wide_linear(x.double(), w.double(), bias.double())
        assert float((got.double() - want).abs().max()) <= tolerance(x, w), (rows, panels)


@pytest.mark.parametrize("direct", [-1, 0])
def test_a_row_does_not_depend_on_the_others(direct: int) -> None:
    """Packed: a row's outputs are the same bits whatever rows share its batch and whatever
    their number (one chain along K per output for every tile shape), up to direct_rows;
    with direct_rows 0 (batch-invariant mode) at every row count. The [N, K] path: the same
    bits whatever the other rows, but the batch size picks loop or panels (unless 0)."""
    g = torch.Generator().manual_seed(3)
    n, k = 70, 300
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = pack_wide_weight(w)
    x = torch.randn(300 if direct == 0 else 48, k, generator=g)
    big = torch.ops.kvserve.wide_linear_packed(x, packed, None, n, direct)  # [M, N]
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 25):
        part = torch.ops.kvserve.wide_linear_packed(x[5 : 5 + rows], packed, None, n, direct)
        assert torch.equal(part, big[5 : 5 + rows]), rows
    other = torch.cat([x[:1], torch.randn(8, k, generator=g)])
    assert torch.equal(torch.ops.kvserve.wide_linear_packed(other, packed, None, n)[0], big[0])
    # the [N, K] path
    big = torch.ops.kvserve.wide_linear(x[:48], w, None, direct)  # [48, N]
    p = max(panel_rows(), 2)
    other = torch.cat([x[:1], torch.randn(p + 2, k, generator=g)])
    assert torch.equal(torch.ops.kvserve.wide_linear(other, w, None, direct)[0], big[0])
    alone = torch.ops.kvserve.wide_linear(x[5:6], w, None, direct)  # [1, N]
    assert torch.equal(alone[0], big[5]) == (direct == 0 or panel_rows() == 0)


def test_bad_input_raises() -> None:
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        torch.ops.kvserve.wide_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="w must be bfloat16, float16 or float32"):
        torch.ops.kvserve.wide_linear(torch.zeros(1, 32), w.to(torch.int8), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvserve.wide_linear(torch.zeros(1, 32), torch.zeros(16, 31).bfloat16(), None)
    packed = pack_wide_weight(torch.zeros(20, 32, dtype=torch.bfloat16))  # [2, 32, 16]
    op = torch.ops.kvserve.wide_linear_packed
    with pytest.raises(RuntimeError, match=r"w must be a contiguous \[ceil\(N / 16\), K, 16\]"):
        op(torch.zeros(1, 32), packed, None, 40)  # 40 channels need 3 strips
    with pytest.raises(RuntimeError, match=r"w must be a contiguous \[ceil"):
        op(torch.zeros(1, 31), packed, None, 20)
    with pytest.raises(RuntimeError, match="w must be bfloat16 or float16"):
        op(torch.zeros(1, 32), packed.float(), None, 20)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        op(torch.zeros(1, 32), packed, torch.zeros(16), 20)


def test_resolve_weight_dtype() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    kw = {"native": True, "quantized": False, "tp": 1}
    # auto: the checkpoint's own 16-bit dtype where kvserve computes in float32 on a CPU
    assert resolve_weight_dtype(None, f32, CPU, bf16, **kw) is bf16
    assert resolve_weight_dtype(None, f32, CPU, f16, **kw) is f16
    assert resolve_weight_dtype(None, f32, CPU, f32, **kw) is None
    assert resolve_weight_dtype(None, bf16, CPU, bf16, **kw) is None
    assert resolve_weight_dtype(None, f32, CPU, bf16, **{**kw, "quantized": True}) is None
    assert resolve_weight_dtype(None, f32, CPU, bf16, **{**kw, "native": False}) is None
    assert resolve_weight_dtype(None, f32, CPU, bf16, **{**kw, "tp": 2}) is None
    # explicit
    assert resolve_weight_dtype(bf16, f32, CPU, f32, **kw) is bf16
    assert resolve_weight_dtype(f32, f32, CPU, bf16, **kw) is None  # off
    assert resolve_weight_dtype(bf16, bf16, CPU, bf16, **kw) is None  # weights in dtype
    refusals = [
        ((f16, bf16, CPU, None, kw), "float16: it is computed in float32, and dtype is"),
        ((f16, f32, torch.device("meta"), None, kw), "float16: it is a CPU path"),
        ((bf16, f32, CPU, None, {**kw, "native": False}), "not the transformers backend"),
        ((bf16, f32, CPU, None, {**kw, "quantized": True}), "quantized linears keep"),
        ((bf16, f32, CPU, None, {**kw, "tp": 2}), "tensor_parallel_size 1"),
    ]
    for (req, dtype, dev, ckpt, k), msg in refusals:
        with pytest.raises(ValueError, match=msg):
            resolve_weight_dtype(req, dtype, dev, ckpt, **k)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same tiny Llama saved in float32 and rounded to bfloat16 (same values widened)."""
    f32 = tmp_path_factory.mktemp("f32")
    model = make_tiny_model("llama", f32)
    bf16 = tmp_path_factory.mktemp("bf16")
    model.to(torch.bfloat16).save_pretrained(bf16)
    return f32, bf16


def wide_layers(model: nn.Module) -> list[WideLinear]:
    return [m for m in model.modules() if isinstance(m, WideLinear)]


def test_auto_keeps_a_bf16_checkpoint_in_bf16(checkpoints: tuple[Path, Path]) -> None:
    f32, bf16 = checkpoints
    auto = load_model(bf16, torch.float32, CPU, 64, prepack=True, fused_ops=True)
    layers = wide_layers(auto)
    # 2 layers x (qkv, o, gate_up, down) + the LM head
    assert len(layers) == 9 and all(m.weight_dtype == torch.bfloat16 for m in layers)
    assert auto.embed_tokens.weight.dtype == torch.float32  # the table stays float32
    off = load_model(bf16, torch.float32, CPU, 64, weight_dtype=torch.float32)
    assert wide_layers(off) == []
    assert wide_layers(load_model(f32, torch.float32, CPU, 64)) == []


def test_logits_equal_float32_weights(checkpoints: tuple[Path, Path]) -> None:
    """Each widened layer gives the float32 layer's outputs on the same inputs, within float32
    rounding: the whole model is then the float32 model of the checkpoint's values."""
    _, bf16 = checkpoints
    plain = load_model(bf16, torch.float32, CPU, 64, weight_dtype=torch.float32)
    wide = load_model(bf16, torch.float32, CPU, 64, weight_dtype=torch.bfloat16)
    x = torch.randn(3, plain.lm_head.in_features)
    with torch.no_grad():
        want = plain.lm_head(x)
        got = wide.lm_head(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert type(wide.lm_head) is WideLinear and widen_linears(wide, torch.bfloat16) == 0


PROMPTS = random_prompts([3, 7, 12, 5, 20, 9])
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(path: Path, **kw: object) -> tuple[list[list[int]], LLMEngine]:
    e = LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4,
                                      num_kv_blocks=120, **kw))  # fmt: skip
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        e.kv.check_integrity()
    return [done[str(i)] for i in range(len(PROMPTS))], e


def test_engine_tokens_with_the_loop_and_without(checkpoints: tuple[Path, Path]) -> None:
    """Widened layers in the C++ decode loop and in the Python layers: the same tokens and
    KV bytes; and the same tokens as the float32 weights of the same values."""
    _, bf16 = checkpoints
    eager, e1 = run(bf16, weight_dtype="bfloat16", enforce_eager=True)
    looped, e2 = run(bf16)  # auto: bf16 from the checkpoint
    assert e2.runner is not None and e2.runner.model.decode_loop is not None
    assert e2.runner.model.decode_loop.steps > 0
    assert len(wide_layers(e2.runner.model)) == 9
    assert looped == eager
    assert e1.runner is not None
    for a, b in zip(e1.runner.kv_caches, e2.runner.kv_caches, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    plain, _ = run(bf16, weight_dtype="float32")
    assert plain == looped
