"""GPTQ checkpoints (``quant_method: gptq``): packed here as GPTQModel's ``pack_original``
packs them (v1 zeros stored minus one, as its ``convert_gptq_v2_to_v1_format`` does), loaded by
``kvserve.quantization.gptq``, and checked against GPTQModel's dequantization
(``scales[g_idx] * (q - zeros[g_idx])``) and through the whole engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from kvserve.config import Quantization
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.quantization.compressed_tensors import checkpoint_scheme
from kvserve.quantization.qlinear import _a8_kernel
from tests.engine.utils import check_runs_as_dequantized, rewrite_projections, split_checkpoint


def _pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """``q [K, N]`` as GPTQModel packs qweight: word r holds rows ``p r + j`` at bits ``b j``."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= q[row * per + j].astype(np.uint32) << np.uint32(bits * j)
    return out


def _pack_cols(z: np.ndarray, bits: int) -> np.ndarray:
    """``z [G, N]`` as GPTQModel packs qzeros: word c holds columns ``p c + j``."""
    per = 32 // bits
    out = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    for col in range(out.shape[1]):
        for j in range(per):
            out[:, col] |= z[:, col * per + j].astype(np.uint32) << np.uint32(bits * j)
    return out


def _act_order(k: int) -> torch.Tensor:
    """A column order for act-order checkpoints, one per input size: GPTQ orders columns by
    the Hessian of the layer's input, so projections of one input (q/k/v, gate/up) share it."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(k))


def _gptq_layer(
    w: torch.Tensor, bits: int, group: int | None, sym: bool, fmt: str, act_order: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear as GPTQ stores it (its quantizer's min/max rule, RTN instead of the
    Hessian updates: the layout is what is under test) and its dequantized weight. With
    ``act_order``, GPTQ's desc_act: group ``j // g`` holds the columns ``order[j]``, so
    ``g_idx[order[j]] = j // g``."""
    n, k = w.shape
    g = group or k
    w = w.float().clone()
    order = _act_order(k) if act_order else torch.arange(k)
    w[0, order[:g]] = w[0, order[:g]].abs() + 0.01  # an all-positive group: zero 0 (v1 borrow)
    maxq = 2**bits - 1
    groups = w.t()[order].reshape(k // g, g, n)  # [G, g, N]
    lo = groups.amin(1).clamp(max=0)
    hi = groups.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-5).half()  # [G, N]
    zero = torch.full_like(lo, (maxq + 1) // 2) if sym else torch.round(-lo / scale.float())
    zero = zero.clamp(0, maxq)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // g
    q = torch.clamp(torch.round(w.t() / scale.float()[g_idx]) + zero[g_idx], 0, maxq)  # [K, N]
    weight = (scale.float()[g_idx] * (q - zero[g_idx])).t().contiguous()  # GPTQModel's rule
    qzeros = _pack_cols(zero.numpy().astype(np.int64), bits)
    if fmt == "gptq":  # v1: convert_gptq_v2_to_v1_format subtracts one from every zero
        qzeros = qzeros - np.uint32(sum(1 << (bits * j) for j in range(32 // bits)))
    tensors = {
        "qweight": torch.from_numpy(_pack_rows(q.numpy().astype(np.int64), bits).view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": scale,
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, weight


def write_gptq(
    src: Path,
    dst: Path,
    bits: int,
    group: int | None,
    sym: bool,
    fmt: str = "gptq",
    act_order: bool = False,
) -> tuple[Path, dict]:
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group or -1,
               "desc_act": act_order, "sym": sym, "checkpoint_format": fmt}  # fmt: skip
    layer = lambda w: _gptq_layer(w, bits, group, sym, fmt, act_order)  # noqa: E731
    return dst, rewrite_projections(src, dst, layer, qconfig)


CASES = [(4, 32, True, "gptq", False), (4, 32, False, "gptq", False),
         (4, 64, False, "gptq_v2", False), (8, None, True, "gptq", False),
         (8, 16, False, "gptq", False), (4, 32, True, "gptq", True),
         (8, 16, False, "gptq_v2", True)]  # fmt: skip


@pytest.mark.parametrize(("bits", "group", "sym", "fmt", "act_order"), CASES)
def test_weights_equal_gptqmodels_dequantization(
    tiny_llama: Path,
    tmp_path: Path,
    bits: int,
    group: int | None,
    sym: bool,
    fmt: str,
    act_order: bool,
) -> None:
    path, want = write_gptq(tiny_llama, tmp_path / "gptq", bits, group, sym, fmt, act_order)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None and scheme.method is Quantization.GPTQ
    assert (scheme.format, scheme.bits, scheme.group_size) == (fmt, bits, group)
    dense, fused = split_checkpoint(load_file(str(path / "model.safetensors")), scheme)
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx")) for name in dense)
    for name, weight in want.items():
        assert torch.equal(dense[name], weight), name
    qkv = fused["layers.1.self_attn.qkv_proj"]
    assert qkv.bits == bits and qkv.group_size == (group or 64) and qkv.shape == (128, 64)
    assert (qkv.zeros is None) == sym  # symmetric: no zeros stored, codes in [-2^(b-1), ...)
    assert int(qkv.codes.min()) >= -(2 ** (bits - 1)) and int(qkv.codes.max()) < 2 ** (bits - 1)
    if act_order:  # stored sorted by group: group j holds the columns order[j g: (j + 1) g]
        g = group or 64
        stored = qkv.in_perm.view(-1, g).sort(1).values  # type: ignore[union-attr]
        assert torch.equal(stored, _act_order(64).view(-1, g).sort(1).values)
    else:
        assert qkv.in_perm is None


@pytest.mark.parametrize("act_order", [False, True])
def test_engine_runs_the_checkpoint_as_its_dequantized_weights(
    tiny_llama: Path, tmp_path: Path, act_order: bool
) -> None:
    path, want = write_gptq(tiny_llama, tmp_path / "gptq", 4, 32, False, act_order=act_order)
    check_runs_as_dequantized(tiny_llama, path, want, "gptq")


@pytest.mark.parametrize(
    "int8_activations",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(
            not _a8_kernel(), reason="the int8-activation kernel needs AVX512-VNNI and -BF16")),
    ],
)  # fmt: skip
def test_act_order_layer_equals_its_reference(tiny_llama: Path, tmp_path: Path,
                                              int8_activations: bool) -> None:  # fmt: skip
    """An act-order layer on the kernels (bf16: int8 activations or bf16 ones) against the
    pure-PyTorch references, which apply the order on their own; the C++ decode loop
    leaves such layers to Python."""
    from kvserve.config import QuantizedActivations
    from kvserve.model.decode_loop import _linear_ok
    from kvserve.quantization.qlinear import QuantLinear, reference_linear, reference_linear_a8

    path, _ = write_gptq(tiny_llama, tmp_path / "gptq", 4, 32, False, act_order=True)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None
    _, fused = split_checkpoint(load_file(str(path / "model.safetensors")), scheme)
    qw = fused["layers.0.mlp.gate_up_proj"]
    assert qw.in_perm is not None
    acts = QuantizedActivations.INT8 if int8_activations else QuantizedActivations.NONE
    layer = QuantLinear(qw, None, torch.device("cpu"), torch.bfloat16, acts)
    assert layer.use_kernel and not _linear_ok(layer) and "act-order" in repr(layer)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = layer(x).double()
    if int8_activations:
        assert layer.path == "a8"
        want = reference_linear_a8(x, qw).double()
        # bf16 rounding of float32 sums against the exact product: within 2^-7 relative
        assert bool(((got - want).abs() <= want.abs() * 2.0**-7 + 1e-3).all())
    else:
        want = reference_linear(x.float(), qw).double()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    path, _ = write_gptq(tiny_llama, tmp_path / "gptq", 4, 32, True)
    with pytest.raises(ValueError, match=r"already quantized \(gptq\); .* 'int4'"):
        LLMEngine(build_engine_config(str(path), dtype="float32", quantization="int4"))
    with pytest.raises(ValueError, match=r"'gptq': .* is not a pre-quantized checkpoint"):
        LLMEngine(build_engine_config(str(tiny_llama), quantization="gptq"))
    cfg = AutoConfig.from_pretrained(path)
    qc = dict(cfg.quantization_config)
    for bad, what in (({"bits": 3}, "3-bit codes"), ({"checkpoint_format": "marlin"}, "Marlin")):
        cfg.quantization_config = qc | bad
        with pytest.raises(ValueError, match=f"GPTQ checkpoint .*{what}"):
            checkpoint_scheme(cfg)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    uneven = state | {name: torch.zeros_like(state[name])}  # every column in group 0
    with pytest.raises(ValueError, match=r"down_proj: GPTQ g_idx does not put 32 columns in"):
        split_checkpoint(uneven, scheme)
    name = "model.layers.0.self_attn.k_proj.g_idx"  # an order q and v do not share
    with pytest.raises(
        ValueError,
        match=r"layers.0.self_attn.qkv_proj: fused weights must "
        r"share their column order",
    ):
        split_checkpoint(state | {name: state[name].flip(0).contiguous()}, scheme)
