"""Native gpt-oss: logits equal transformers' (float32, prefill then decode, both CPU attention
backends) with its sinks, alternating sliding/full layers, YaRN RoPE and biased clamped-SwiGLU
experts; MXFP4 experts dequantize as the format defines (a hand-made block) and load into the
model; quantizations other than int8/int4 RTN are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from kvserve.config import CpuLinearKernel, ModelConfig, Quantization, QuantizedActivations
from kvserve.model.gpt_oss import GptOssForCausalLM, GptOssMoeBlock
from kvserve.model.llama import RotaryEmbedding
from kvserve.model.loader import load_model
from kvserve.model.wide_linear import WideLinear, bf16_kernel_linears
from kvserve.ops import cpu_kernels
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.mxfp4 import dequantize_mxfp4, fp4_e2m1_values, mxfp4_qweight
from kvserve.quantization.qlinear import QuantLinear
from tests.model.tiny_moe import GPT_OSS, WINDOW, make_moe_model, moe_config
from tests.model.tiny_native import kvserve_logits

IDS = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_moe_model(GPT_OSS, path)


def reference_logits(hf: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([IDS]), use_cache=False).logits[0, 8:]  # [12, V]


@pytest.mark.parametrize("use_kernel", [False, True])
def test_logits_match_transformers(gpt_oss: tuple[Path, PreTrainedModel], use_kernel: bool) -> None:
    """A 9-token prefill then 11 decode steps (past the 8-token window of layer 0) on the SDPA
    backend or the C++ decode kernel; without the sinks the logits differ."""
    path, hf = gpt_oss
    if use_kernel and not cpu_kernels.available():
        pytest.skip("no C++ kernels")
    assert len(IDS) > WINDOW and hf.config.layer_types == ["sliding_attention", "full_attention"]
    model = load_model(path, torch.float32, "cpu", max_positions=64)
    assert isinstance(model, GptOssForCausalLM)
    assert all(isinstance(layer.mlp, GptOssMoeBlock) for layer in model.layers)
    windows = [layer.self_attn.attn_kwargs.get("sliding_window") for layer in model.layers]
    assert windows == [WINDOW, None]
    want = reference_logits(hf)
    torch.testing.assert_close(kvserve_logits(model, IDS, 9, use_kernel), want, atol=2e-5,
                               rtol=1e-5)  # fmt: skip
    for layer in model.layers:
        layer.self_attn.sinks = None
    assert not torch.allclose(kvserve_logits(model, IDS, 9, use_kernel), want, atol=1e-3)


def test_yarn_rope_equals_transformers() -> None:
    """kvserve's cos/sin tables for the tiny config's YaRN (x8 over 64 positions, attention
    factor folded in) equal transformers' gpt-oss rotary embedding at every position."""
    cfg = moe_config(GPT_OSS)
    assert cfg.rope_parameters["rope_type"] == "yarn"
    ours = RotaryEmbedding(cfg, cfg.head_dim, 300)
    pos = torch.arange(300)
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    half = cfg.head_dim // 2  # transformers' tables are [P, D/2]; kvserve's repeat them
    torch.testing.assert_close(ours.cos[:, :half], cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.sin[:, half:], sin[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(ours.cos[:, :half].abs().amax(), torch.tensor(1.0))  # scaled


def test_mxfp4_hand_made_block() -> None:
    """One block of 32 codes with scale 2^(129 - 127) = 4, and one with 2^-1: each byte's
    low nibble is the even element (E2M1: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives)."""
    assert fp4_e2m1_values().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6,
                                          -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]  # fmt: skip
    codes = list(range(16)) * 2  # element i has code i % 16
    packed = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    blocks = torch.tensor([packed, packed], dtype=torch.uint8)  # [G=2, 16]
    scales = torch.tensor([129, 126], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)  # [64]
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert out[:32].tolist() == [4 * lut[c] for c in codes]
    assert out[32:].tolist() == [0.5 * lut[c] for c in codes]
    assert out[1].item() == 2.0 and out[15].item() == -24.0
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, torch.tensor([255, 1], dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:1])


def _mxfp4_codes(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 blocks ``[E, rows, cols / 32, 16]`` and scales around 2^-4."""
    e, rows, cols = shape
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 126, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def write_mxfp4(src: Path, dst: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``src``'s checkpoint at ``dst`` with random MXFP4 experts (``quant_method: mxfp4``, as
    OpenAI's): its config, transformers' dequantized ``[E, in, out]`` experts by name, and
    each expert tensor's (blocks, scales)."""
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    dense, stored = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = _mxfp4_codes((e, rows, cols), gen)
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            stored[name] = (blocks, scales)
            ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)
            assert torch.equal(ours, dense[name])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return cfg, dense, stored


def test_mxfp4_checkpoint_loads_dequantized(
    gpt_oss: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    """A checkpoint whose experts are MXFP4 blocks and scales (``quant_method: mxfp4``, as
    OpenAI's) gives the logits of transformers' model holding the same experts dequantized by
    transformers' own converter (which also checks this dequantizer against it)."""
    src, hf = gpt_oss
    _, dense, _ = write_mxfp4(src, tmp_path)
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict({**hf.state_dict(), **dense})
    model = load_model(tmp_path, torch.float32, "cpu", max_positions=64)
    got = kvserve_logits(model, IDS, 9, False)
    torch.testing.assert_close(got, reference_logits(reference), atol=2e-5, rtol=1e-5)
    # int4 on top (how gpt-oss-20b's experts would fit in memory): the same RTN of the same
    # dequantized values as from the dense checkpoint, so the same logits bit for bit
    reference.save_pretrained(tmp_path / "dense")
    int4 = QuantOptions(Quantization.INT4)
    runs = [kvserve_logits(load_model(p, torch.float32, "cpu", 64, quant=int4), IDS, 9, False)
            for p in (tmp_path, tmp_path / "dense")]  # fmt: skip
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], got)


def test_mxfp4_qweight_is_the_dequantized_block_bit_for_bit() -> None:
    """Every E2M1 code and every scale byte but NaN's: codes * scales == dequantize_mxfp4's
    float32 values, codes twice the E2M1 values (integers), scales powers of two."""
    codes = torch.arange(256, dtype=torch.uint8)  # every pair of E2M1 codes once
    blocks = codes.repeat(255).reshape(255, 16, 16)  # [N 255, G 16, 16]
    scales = torch.arange(255, dtype=torch.uint8).reshape(255, 1).expand(255, 16).contiguous()
    qw = mxfp4_qweight(blocks, scales)
    assert qw.bits == 8 and qw.group_size == 32 and qw.zeros is None
    assert torch.equal(qw.dequantize(), dequantize_mxfp4(blocks, scales))
    assert set(qw.codes.unique().tolist()) == {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8,
                                               -12}  # fmt: skip
    assert torch.equal(torch.log2(qw.scales[:, 0].double()), torch.arange(255.0) - 128)
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_qweight(blocks[:1], torch.full((1, 16), 255, dtype=torch.uint8))


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
def test_mxfp4_experts_kept_as_stored(
    gpt_oss: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    """``--quantization mxfp4``: each expert is a quantized layer holding its blocks' values
    exactly (the layer times an identity gives the dequantized weight, gate rows then up
    rows, bit for bit), nothing else is quantized, and the logits are the dequantized
    model's (another summation order: within float32 rounding)."""
    src, _ = gpt_oss
    cfg, _, stored = write_mxfp4(src, tmp_path)
    dense = load_model(tmp_path, torch.float32, "cpu", max_positions=64)
    keep = QuantOptions(Quantization.MXFP4, activations=QuantizedActivations.NONE)
    kept = load_model(tmp_path, torch.float32, "cpu", max_positions=64, quant=keep)
    e, layers = cfg["num_local_experts"], cfg["num_hidden_layers"]
    report = kept.quant_report  # type: ignore[attr-defined]
    assert report.method == "mxfp4" and report.layers == 2 * e * layers
    assert not any(isinstance(m, QuantLinear) for m in kept.layers[0].self_attn.modules())
    for layer in range(layers):
        experts = kept.layers[layer].mlp.experts
        assert experts.gate_up_proj.numel() == 0  # the dense stacks were never kept
        for proj, q in (("gate_up_proj", experts.q_gate_up), ("down_proj", experts.q_down)):
            blocks, scales = stored[f"model.layers.{layer}.mlp.experts.{proj}"]
            for i in range(e):
                want = dequantize_mxfp4(blocks[i], scales[i])  # [rows, cols]
                if proj == "gate_up_proj":
                    want = torch.cat([want[0::2], want[1::2]])
                assert isinstance(q[i], QuantLinear) and q[i].path == "kernel"
                got = q[i](torch.eye(want.shape[1])).t()  # [rows, cols]
                assert torch.equal(got, want), (layer, proj, i)
    want = kvserve_logits(dense, IDS, 9, True)
    torch.testing.assert_close(kvserve_logits(kept, IDS, 9, True), want, atol=1e-5, rtol=1e-5)
    # in bf16 the linears stay dense, so they take the packed bf16 layout where a dense
    # model's would (AVX512-BF16 kernels, no AMX), oneDNN's packing elsewhere
    bf16 = load_model(tmp_path, torch.bfloat16, "cpu", 64, prepack=True, quant=keep)
    packed = bf16_kernel_linears(CpuLinearKernel.AUTO, torch.bfloat16, torch.device("cpu"),
                                 native=True, quantized=False, tp=1)  # fmt: skip
    qkv = bf16.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, WideLinear) == packed, type(qkv)


def test_mxfp4_refused_elsewhere(gpt_oss: tuple[Path, PreTrainedModel]) -> None:
    """mxfp4 keeps MXFP4 experts; a checkpoint without them is refused by name, and so is
    the LM head flag with it."""
    src, _ = gpt_oss
    with pytest.raises(ValueError, match="not a gpt-oss checkpoint with MXFP4 experts"):
        load_model(src, torch.float32, "cpu", 64, quant=QuantOptions(Quantization.MXFP4))
    with pytest.raises(ValueError, match="quantization_lm_head is not for quantization 'mxfp4'"):
        ModelConfig(str(src), quantization="mxfp4", quantization_lm_head=True)


def test_quantization_refused() -> None:
    """int8/int4 RTN, mxfp4 and gguf run (tests/engine/test_gpt_oss.py, above,
    test_gguf_gpt_oss.py); the others are refused by name."""
    runs = (Quantization.INT8, Quantization.INT4, Quantization.MXFP4, Quantization.GGUF)
    for method in Quantization:
        reason = GptOssForCausalLM.quantization_refusal(method)
        if method in runs:
            assert reason is None
        else:
            assert reason is not None and "gpt-oss" in reason and "MXFP4" in reason
    assert GptOssForCausalLM.quantization_refusal(None) is None
