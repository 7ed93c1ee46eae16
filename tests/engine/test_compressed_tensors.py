"""Pre-quantized compressed-tensors checkpoints (W4A16 / W8A16), checked against the
compressed-tensors library's own decompression and through the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file
from transformers import AutoConfig

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.quantization.compressed_tensors import checkpoint_scheme
from kvserve.quantization.qlinear import QuantLinear
from tests.engine.utils import check_runs_as_dequantized, rewrite_projections, split_checkpoint


def _compress(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> dict:
    """One layer as llm-compressor writes it: signed codes, scales (and zero points)."""
    n, k = w.shape
    g = group or k
    groups = w.float().reshape(n, k // g, g)
    qmax, qmin = 2 ** (bits - 1) - 1, -(2 ** (bits - 1))
    if symmetric:
        scale = groups.abs().amax(-1) / ((qmax - qmin) / 2)
        zp = torch.zeros_like(scale)
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = (hi - lo) / (qmax - qmin)
        zp = torch.round(qmin - lo / scale).clamp(qmin, qmax)
    q = torch.round(groups / scale[..., None] + zp[..., None]).clamp(qmin, qmax)
    out = {
        "weight_packed": pack_to_int32(q.reshape(n, k).to(torch.int8), bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), bits, packed_dim=0)
    return out


def _config(bits: int, group: int | None, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group else "channel", "group_size": group}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def write_checkpoint(src: Path, dst: Path, bits: int, group: int | None, sym: bool) -> Path:
    rewrite_projections(src, dst, lambda w: (_compress(w, bits, group, sym), None),
                        _config(bits, group, sym))  # fmt: skip
    return dst


@pytest.mark.parametrize(("bits", "group", "sym"), [(4, 32, True), (4, 32, False),
                                                    (8, None, True), (8, 16, False)])  # fmt: skip
def test_weights_equal_the_library_decompression(
    tiny_llama: Path, tmp_path: Path, bits: int, group: int | None, sym: bool
) -> None:
    path = write_checkpoint(tiny_llama, tmp_path / "ct", bits, group, sym)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None and (scheme.bits, scheme.group_size) == (bits, group)
    state = load_file(str(path / "model.safetensors"))
    dense, fused = split_checkpoint(state, scheme)
    args = QuantizationArgs(**_config(bits, group, sym)["config_groups"]["group_0"]["weights"])
    lib = QuantizationScheme(targets=["Linear"], weights=args)
    for proj in ("q_proj", "down_proj"):
        prefix = f"model.layers.1.{'self_attn' if proj == 'q_proj' else 'mlp'}.{proj}"
        params = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.startswith(prefix + ".")}
        want = PackedQuantizationCompressor.decompress(params, lib)["weight"].float()
        torch.testing.assert_close(dense[f"{prefix}.weight"], want, rtol=0, atol=1e-6)
    qkv = fused["layers.1.self_attn.qkv_proj"]
    assert qkv.bits == bits and qkv.shape == (128, 64)


def test_engine_runs_the_checkpoint_as_its_dequantized_weights(
    tiny_llama: Path, tmp_path: Path
) -> None:
    path = write_checkpoint(tiny_llama, tmp_path / "ct", 4, 32, True)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None
    dense, _ = split_checkpoint(load_file(str(path / "model.safetensors")), scheme)
    check_runs_as_dequantized(tiny_llama, path, dense, "compressed-tensors")


def test_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    path = write_checkpoint(tiny_llama, tmp_path / "ct", 4, 32, True)
    with pytest.raises(ValueError, match=r"already quantized .* without quantization 'int4'"):
        LLMEngine(build_engine_config(str(path), dtype="float32", quantization="int4"))
    with pytest.raises(
        ValueError, match=r"'compressed-tensors': .* not a pre-quantized checkpoint"
    ):
        LLMEngine(build_engine_config(str(tiny_llama), quantization="compressed-tensors"))
    cfg = AutoConfig.from_pretrained(path)
    qc = dict(cfg.quantization_config)
    group = {**qc["config_groups"]["group_0"], "input_activations": {"num_bits": 8, "type": "int"}}
    qc["config_groups"] = {"group_0": group}
    cfg.quantization_config = qc
    with pytest.raises(ValueError, match="quantizes activations"):
        checkpoint_scheme(cfg)
    cfg.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match=r"quantized with 'bitsandbytes'; kvserve loads .* GPTQ"):
        checkpoint_scheme(cfg)


def test_lm_head_quantized_beside_the_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    """--quantization compressed-tensors --quantization-lm-head: the checkpoint's own layers,
    and its float LM head rounded to int8 per row."""
    from kvserve.quantization.lm_head import QuantLMHead
    from kvserve.quantization.qweight import quantize_rtn

    path = write_checkpoint(tiny_llama, tmp_path / "ct", 4, 32, True)
    cfg = build_engine_config(str(path), dtype="float32", num_kv_blocks=16,
                              quantization="compressed-tensors", quantization_lm_head=True,
                              quantization_activations="none")  # fmt: skip
    model = LLMEngine(cfg).runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(model.lm_head, QuantLMHead)
    assert model.quant_report.lm_head.startswith("int8 per channel")
    head = load_file(str(tiny_llama / "model.safetensors"))["lm_head.weight"]
    got = model.lm_head(torch.eye(head.shape[1])).t()
    assert torch.equal(got, quantize_rtn(head, 8, None).dequantize())
