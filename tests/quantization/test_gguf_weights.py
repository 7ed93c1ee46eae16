"""GGUF quantized tensors load to exactly the values gguf's own dequantizer gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvserve.quantization.gguf_weights import tensor_to_qweight

N, K = 32, 512


def _float_weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


def _random_k_blocks(qtype: T, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to them) with finite f16 scales."""
    rng = np.random.default_rng(seed)
    size = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (N * K // 256, size), dtype=np.uint8)
    d = (rng.random(len(blocks)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == T.Q4_K:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = d[::-1]  # dmin
    else:
        blocks[:, 208:210] = d
    return blocks.reshape(N, -1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K])
def test_values_equal_gguf_dequantize(qtype: T) -> None:
    if qtype in (T.Q4_K, T.Q6_K):
        raw = _random_k_blocks(qtype, 1)
    else:
        raw = quantize(_float_weights(0), qtype)  # [N, bytes per row]
    qw = tensor_to_qweight("blk.0.attn_q.weight", qtype, raw, N, K)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(N, K).astype(np.float32))
    assert torch.equal(qw.dequantize(torch.float32), want)
    assert qw.bits == (8 if qtype in (T.Q8_0, T.Q6_K) else 4)
    assert qw.group_size == (16 if qtype == T.Q6_K else 32)
    # float16 scales where GGUF stores them so (Q8_0, Q4_0, Q4_1): no extra bytes
    assert (qw.scales.dtype == torch.float16) == (qtype in (T.Q8_0, T.Q4_0, T.Q4_1))


def test_unsupported_type_is_refused_by_name() -> None:
    raw = quantize(_float_weights(2), T.Q5_0)
    want = r"'blk\.3\.ffn_up\.weight' has type Q5_0, .*supported: \['Q8_0', 'Q4_0', 'Q4_1', 'Q4_K'"
    with pytest.raises(ValueError, match=want):
        tensor_to_qweight("blk.3.ffn_up.weight", T.Q5_0, raw, N, K)


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
