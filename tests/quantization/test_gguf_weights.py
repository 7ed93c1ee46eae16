"""GGUF quantized tensors load to exactly the values gguf's own dequantizer gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.quantization.gguf_blocks import LAYOUTS, SUPPORTED_TYPES
from kvserve.quantization.gguf_weights import tensor_to_qweight
from kvserve.quantization.qlinear import QuantLinear, int4_offset
from tests.quantization.test_qlinear import needs_kernels

N, K = 32, 512


def _float_weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


# where each type's float16 fields (d, m / dmin) lie in its block
_F16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_XS: (0,), T.MXFP4: (),
}  # fmt: skip
# what gguf-py can quantize to (the rest it only dequantizes: their blocks are random bytes)
_QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)


def _random_k_blocks(qtype: T, seed: int) -> np.ndarray:
    """Random blocks of ``qtype`` (every bit pattern is a valid block) with finite float16
    scales of either sign (MXFP4: small powers of two), as ``[N, bytes per row]``."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (N * K // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # an E8M0 exponent byte: 2^-28 .. 2^-1 (a random byte overflows)
        blocks[:, 0] = rng.integers(100, 127, len(blocks), dtype=np.uint8)
    return blocks.reshape(N, -1)


def test_every_kept_type_is_tested() -> None:
    assert set(_F16_FIELDS) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_values_equal_gguf_dequantize(qtype: T) -> None:
    raws = [_random_k_blocks(qtype, 1)]
    if qtype in _QUANTIZABLE:  # and blocks gguf's own quantizer writes
        raws.append(quantize(_float_weights(0), qtype))
    for raw in raws:
        qw = tensor_to_qweight("blk.0.attn_q.weight", qtype, raw, N, K)
        want = torch.from_numpy(dequantize(raw, qtype).reshape(N, K).astype(np.float32))
        assert torch.equal(qw.dequantize(torch.float32), want)
    assert (qw.group_size, qw.bits) == LAYOUTS[qtype]
    # float16 scales where GGUF stores them so (d of the 32-value blocks): no extra bytes
    f16 = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL)
    assert (qw.scales.dtype == torch.float16) == (qtype in f16)
    if qw.bits == 4:  # codes in an int4 range the kernels pack
        assert int4_offset(qw.codes) in (0, 8)


@needs_kernels
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_kernel_equals_gguf_dequantized_linear(qtype: T) -> None:
    """The float32 layer of each type's weight: gguf's values times x, in the kernel's order
    of sums (few ulps), on the direct (1 row) and tile (7 rows) paths."""
    raw = _random_k_blocks(qtype, 2)
    qw = tensor_to_qweight("blk.0.ffn_up.weight", qtype, raw, N, K)
    layer = QuantLinear(qw, None, torch.device("cpu"), torch.float32)
    assert layer.use_kernel
    w = torch.from_numpy(dequantize(raw, qtype).reshape(N, K).astype(np.float64))
    for rows in (1, 7):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        ref = (x.double() @ w.t()).float()
        out = layer(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_type_without_a_quantized_layer_is_refused_by_name() -> None:
    raw = quantize(_float_weights(2), T.TQ1_0)
    want = r"'blk\.3\.ffn_up\.weight' has type TQ1_0, .*supported: \['Q8_0', 'Q4_0', 'Q4_1', 'Q5_0'"
    with pytest.raises(ValueError, match=want):
        tensor_to_qweight("blk.3.ffn_up.weight", T.TQ1_0, raw, N, K)


@pytest.mark.slow
def test_builtin_gguf_layers_equal_the_converted_folder(builtin_model_dir: Path) -> None:
    """Every quantized layer of the built-in Q4_1 model holds exactly the float32 values the
    GGUF converter wrote (dequantized, rotary rows unpermuted, q/k/v and gate/up fused)."""
    from safetensors import safe_open

    from kvserve.config import Quantization
    from kvserve.model.builtin import find_builtin_gguf
    from kvserve.model.loader import load_model
    from kvserve.quantization.apply import QuantOptions
    from kvserve.quantization.qlinear import QuantLinear

    quant = QuantOptions(Quantization.GGUF, None, str(find_builtin_gguf()))
    model = load_model(builtin_model_dir, torch.float32, "cpu", 256, quant=quant)
    with safe_open(str(builtin_model_dir / "model.safetensors"), framework="pt") as f:
        attn = model.layers[5].self_attn
        assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.bits == 4
        # the layer's codes are packed for the kernel; compare its output on the identity
        eye = torch.eye(attn.qkv_proj.in_features)
        got = attn.qkv_proj(eye).t()  # [N, K]: row n is W[n, :]
        want = torch.cat([f.get_tensor(f"model.layers.5.self_attn.{p}_proj.weight")
                          for p in "qkv"])  # fmt: skip
        assert torch.equal(got, want)
        mlp = model.layers[29].mlp
        got = mlp.down_proj(torch.eye(mlp.down_proj.in_features)).t()
        assert torch.equal(got, f.get_tensor("model.layers.29.mlp.down_proj.weight"))
    assert model.quant_report.layers == 30 * 4
    assert not isinstance(model.lm_head, QuantLinear)
