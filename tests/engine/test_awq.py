"""AutoAWQ checkpoints (``quant_method: awq``, GEMM layout): packed here as AutoAWQ's
``WQLinear_GEMM.from_linear`` packs them, loaded through compressed-tensors' converter, and
checked against AutoAWQ's dequantization rule and through the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from kvserve.config import Quantization
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import check_shardable
from kvserve.quantization.compressed_tensors import checkpoint_scheme
from tests.engine.utils import check_runs_as_dequantized, rewrite_projections, split_checkpoint

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i holds column ORDER[i]


def _pack(t: torch.Tensor) -> torch.Tensor:
    """``t [R, C]`` int32 in [0, 15] as AutoAWQ packs it along C: ``[R, C / 8]`` int32."""
    out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int32)
    for i, col in enumerate(ORDER):
        out |= t[:, col::8] << (4 * i)
    return out


def _awq_layer(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear as AutoAWQ writes it (its zero-point rule, ``pseudo_quantize_tensor``), and
    the weight AutoAWQ computes from it: ``(q - zero) * scale``, float16 scales."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo).clamp(min=1e-5) / 15  # [N, K/g]
    zero = (-torch.round(lo / scale)).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)  # [N, K/g, g]
    half = scale.half()
    weight = ((q - zero[..., None]) * half.float()[..., None]).reshape(n, k)
    tensors = {
        "qweight": _pack(q.reshape(n, k).to(torch.int32).t().contiguous()),  # [K, N/8]
        "qzeros": _pack(zero.to(torch.int32).t().contiguous()),  # [K/g, N/8]
        "scales": half.t().contiguous(),  # [K/g, N]
    }
    return tensors, weight


def write_awq(src: Path, dst: Path, group: int, **config: object) -> tuple[Path, dict]:
    """``src``'s checkpoint with its projections as AutoAWQ GEMM layers, and their weights."""
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
               "version": "gemm", "modules_to_not_convert": None, **config}  # fmt: skip
    return dst, rewrite_projections(src, dst, lambda w: _awq_layer(w, group), qconfig)


def test_pack_order() -> None:
    """Columns 0..7 holding 0..7 pack to nibbles 0, 2, 4, 6, 1, 3, 5, 7: 0x75316420."""
    assert _pack(torch.arange(8, dtype=torch.int32)[None]).item() == 0x75316420


def test_weights_equal_awqs_dequantization(tiny_llama: Path, tmp_path: Path) -> None:
    path, want = write_awq(tiny_llama, tmp_path / "awq", 32)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None and scheme.method is Quantization.AWQ
    assert (scheme.bits, scheme.group_size, scheme.symmetric) == (4, 32, False)
    dense, fused = split_checkpoint(load_file(str(path / "model.safetensors")), scheme)
    assert not any(name.endswith(("qweight", "qzeros", "scales")) for name in dense)
    for name, weight in want.items():
        assert torch.equal(dense[name], weight), name
    qkv = fused["layers.1.self_attn.qkv_proj"]
    assert qkv.bits == 4 and qkv.group_size == 32 and qkv.shape == (128, 64)
    attn = "model.layers.1.self_attn"
    expected = torch.cat([want[f"{attn}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.dequantize(torch.float32), expected)


def test_engine_runs_the_checkpoint_as_its_dequantized_weights(
    tiny_llama: Path, tmp_path: Path
) -> None:
    path, want = write_awq(tiny_llama, tmp_path / "awq", 32)
    check_runs_as_dequantized(tiny_llama, path, want, "awq")


def test_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    path, _ = write_awq(tiny_llama, tmp_path / "awq", 32)
    for method in ("int4", "compressed-tensors"):
        with pytest.raises(ValueError, match=rf"already quantized \(awq\); .* '{method}'"):
            LLMEngine(build_engine_config(str(path), dtype="float32", quantization=method))
    with pytest.raises(ValueError, match=r"'awq': .* is not a pre-quantized checkpoint"):
        LLMEngine(build_engine_config(str(tiny_llama), quantization="awq"))
    cfg = AutoConfig.from_pretrained(path)
    qc = dict(cfg.quantization_config)
    for bad, what in (({"version": "gemv"}, "gemv"), ({"bits": 8}, "4-bit")):
        cfg.quantization_config = qc | bad
        with pytest.raises(ValueError, match=rf"AutoAWQ checkpoint: .*{what}.*\(version 'gemm'\)"):
            checkpoint_scheme(cfg)
    with pytest.raises(ValueError, match="native models only, not the transformers backend"):
        LLMEngine(build_engine_config(str(path), dtype="float32", model_impl="transformers"))
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=r"^quantization 'awq' does not support tensor par"):
        check_shardable(path, LlamaForCausalLM, scheme, None, 2)
