"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture), written here as llama.cpp's
``convert_hf_to_gguf.py`` writes them from an OpenAI-style checkpoint with MXFP4 experts
(``write_gpt_oss_gguf``; ``test_gguf_llamacpp.py`` holds it to llama.cpp's own converter):
the experts' MXFP4 blocks repacked into GGUF's nibble order, gate and up split apart, their
biases likewise, the sinks as ``attn_sinks``. The converted folder holds the checkpoint's
values, the logits equal transformers' on the same (dequantized) experts, dense and with
``--quantization gguf`` keeping the MXFP4 blocks, and the engine's greedy tokens agree."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import PreTrainedModel

from kvserve.config import Quantization, QuantizedActivations
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.gpt_oss import GptOssForCausalLM
from kvserve.model.loader import load_model
from kvserve.quantization.a8_table import A8_TABLE, TABLE_OFFSET
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.mxfp4 import dequantize_mxfp4
from kvserve.quantization.qlinear import A8Scales, QuantLinear
from tests.model.test_gguf import _write_gguf
from tests.model.test_gguf_families import FAST
from tests.model.test_gguf_gemma_phi3 import add_tiny_tokenizer
from tests.model.test_gpt_oss import IDS, reference_logits, write_mxfp4
from tests.model.tiny_moe import GPT_OSS, make_moe_model
from tests.model.tiny_native import kvserve_logits
from tests.quantization.test_qlinear_a8 import needs_a8

ARCH = "gpt-oss"
# the HF names of a layer's tensors other than the experts -> llama.cpp's
_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's MXFP4 ``blocks [..., G, 16]`` and ``scales [..., G]`` as GGUF's MXFP4
    rows ``[..., G * 17]``: per block the E8M0 byte, then 16 bytes whose low nibbles are
    elements 0..15 and high nibbles 16..31 (the checkpoint's bytes hold elements 2j, 2j + 1)."""
    b = blocks.numpy()
    nib = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)  # element order
    packed = nib[..., :16] | (nib[..., 16:] << 4)
    out = np.concatenate([scales.numpy()[..., None], packed.astype(np.uint8)], axis=-1)
    return out.reshape(*b.shape[:-2], -1)


def gguf_tensors(folder: Path) -> dict[str, tuple[np.ndarray, T | None]]:
    """The MXFP4 checkpoint in ``folder`` under llama.cpp's names: (array, raw type or None
    for float32)."""
    state = load_file(str(folder / "model.safetensors"))
    out: dict[str, tuple[np.ndarray, T | None]] = {}
    for name, t in state.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = (t.numpy(), None)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.sinks":
            out[blk + "attn_sinks.weight"] = (t.numpy(), None)
        elif rest == "mlp.experts.gate_up_proj_bias":  # [E, 2I] interleaved
            out[blk + "ffn_gate_exps.bias"] = (t[:, ::2].numpy(), None)
            out[blk + "ffn_up_exps.bias"] = (t[:, 1::2].numpy(), None)
        elif rest == "mlp.experts.down_proj_bias":
            out[blk + "ffn_down_exps.bias"] = (t.numpy(), None)
        elif rest == "mlp.experts.gate_up_proj_blocks":  # rows gate0, up0, gate1, ...
            scales = state[name.replace("_blocks", "_scales")]
            out[blk + "ffn_gate_exps.weight"] = (gguf_mxfp4(t[:, ::2], scales[:, ::2]), T.MXFP4)
            out[blk + "ffn_up_exps.weight"] = (gguf_mxfp4(t[:, 1::2], scales[:, 1::2]), T.MXFP4)
        elif rest == "mlp.experts.down_proj_blocks":
            scales = state[name.replace("_blocks", "_scales")]
            out[blk + "ffn_down_exps.weight"] = (gguf_mxfp4(t, scales), T.MXFP4)
        elif not rest.endswith("_scales"):
            base, suffix = rest.rsplit(".", 1)
            out[f"{blk}{_BLOCK[base]}.{suffix}"] = (t.numpy(), None)
    return out


def write_gpt_oss_gguf(folder: Path, path: Path, head: T | None = None) -> Path:
    """The MXFP4 checkpoint in ``folder`` as llama.cpp's converter writes it (``--outtype
    f32``: the experts stay MXFP4, the rest float32; ``head``: ``output.weight`` quantized to
    that type by gguf-py, as ``--outtype q8_0`` writes it)."""
    c = json.loads((folder / "config.json").read_text())
    rope = c["rope_parameters"]

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(c["hidden_size"])
        w.add_block_count(c["num_hidden_layers"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_sliding_window(c["sliding_window"])
        w.add_expert_feed_forward_length(c["intermediate_size"])
        add_tiny_tokenizer(w)
        for name, (t, qtype) in gguf_tensors(folder).items():
            if name == "output.weight" and head is not None:
                w.add_tensor(name, quantize(np.ascontiguousarray(t, np.float32), head),
                             raw_dtype=head)  # fmt: skip
            elif qtype is None:
                w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
            else:
                w.add_tensor(name, np.ascontiguousarray(t), raw_dtype=qtype)

    return _write_gguf(path, ARCH, fill)


@pytest.fixture(scope="module")
def gpt_oss_gguf(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path]:
    """(transformers' model holding the MXFP4 experts dequantized, the MXFP4 checkpoint's
    folder, its experts dequantized by name, its GGUF). llama.cpp's graph hard-codes the
    SwiGLU limit at 7 (GGUF has no key for it): the tiny model takes it."""
    work = tmp_path_factory.mktemp("gpt_oss_gguf")
    hf = make_moe_model(GPT_OSS, work / "dense", swiglu_limit=7.0)
    (work / "mxfp4").mkdir()
    _, dense, _ = write_mxfp4(work / "dense", work / "mxfp4")
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict({**hf.state_dict(), **dense})
    path = write_gpt_oss_gguf(work / "mxfp4", work / "gpt-oss.gguf")
    return reference, work / "mxfp4", dense, path


def test_converted_folder_holds_the_checkpoint(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """Config as the checkpoint's (window pattern, YaRN unrounded, experts); every tensor the
    checkpoint's value: each expert's gate / up / down the MXFP4 blocks dequantized, the
    stacked biases split, sinks and router under the checkpoint's names."""
    reference, folder, dense, path = gpt_oss_gguf
    out = convert_gguf(path, tmp_path / "out")
    got = json.loads((out / "config.json").read_text())
    want = reference.config.to_dict()
    keys = ("architectures", "layer_types", "sliding_window", "rope_parameters",
            "num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim",
            "attention_bias", "swiglu_limit", "swiglu_alpha", "num_key_value_heads")  # fmt: skip
    for key in keys:
        assert got[key] == want[key], key
    assert got["rope_parameters"]["truncate"] is False
    ours = load_file(str(out / "model.safetensors"))
    state = load_file(str(folder / "model.safetensors"))
    e = want["num_local_experts"]
    for layer in range(want["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        gate_up = dense[p + "mlp.experts.gate_up_proj"]  # [E, H, 2I]: x @ W, interleaved
        down = dense[p + "mlp.experts.down_proj"]  # [E, I, H]
        for i in range(e):
            ex = f"{p}mlp.experts.{i}."
            assert torch.equal(ours[ex + "gate_proj.weight"], gate_up[i][:, ::2].T)
            assert torch.equal(ours[ex + "up_proj.weight"], gate_up[i][:, 1::2].T)
            assert torch.equal(ours[ex + "down_proj.weight"], down[i].T)
        bias = state[p + "mlp.experts.gate_up_proj_bias"]
        assert torch.equal(ours[p + "mlp.experts.gate_proj_bias"], bias[:, ::2])
        assert torch.equal(ours[p + "mlp.experts.up_proj_bias"], bias[:, 1::2])
        same = ("mlp.experts.down_proj_bias", "self_attn.sinks", "mlp.router.weight",
                "mlp.router.bias", "self_attn.o_proj.bias", "self_attn.q_proj.weight")  # fmt: skip
        for name in same:
            assert torch.equal(ours[p + name], state[p + name]), name
    assert len(ours) == 3 + 2 * (3 * e + 3 + 13)  # globals; per layer experts, biases, rest


def test_logits_equal_transformers_dense_and_kept(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """The converted folder (dequantized experts) and ``--quantization gguf`` (each expert a
    quantized layer of the file's MXFP4 blocks, as table codes: its values bit for bit) give
    transformers' logits on the same experts, prefill then decode past the window, through
    the PyTorch grouped path and the C++ experts op."""
    reference, folder, _, path = gpt_oss_gguf
    want = reference_logits(reference)
    out = convert_gguf(path, tmp_path / "out")
    dense = load_model(out, torch.float32, "cpu", max_positions=64)
    assert isinstance(dense, GptOssForCausalLM)
    torch.testing.assert_close(kvserve_logits(dense, IDS, 9, False), want, atol=2e-5, rtol=1e-5)
    keep = QuantOptions(Quantization.GGUF, None, str(path),
                        activations=QuantizedActivations.NONE)  # fmt: skip
    kept = load_model(out, torch.float32, "cpu", 64, quant=keep)
    e, layers = reference.config.num_local_experts, reference.config.num_hidden_layers
    assert kept.quant_report.layers == 2 * e * layers  # type: ignore[attr-defined]
    state = load_file(str(folder / "model.safetensors"))
    experts = kept.layers[1].mlp.experts
    down = "model.layers.1.mlp.experts.down_proj"
    blocks, scales = state[down + "_blocks"], state[down + "_scales"]
    for i in range(e):
        assert isinstance(experts.q_down[i], QuantLinear)
        # float32: the weight-only kernel's table codes (4-bit indices, float16 scales)
        assert (experts.q_down[i].code_bits, experts.q_down[i].offset) == (4, TABLE_OFFSET)
        assert experts.q_down[i].scales_t.dtype == torch.float16
        value = experts.q_down[i](torch.eye(blocks.shape[2] * 32)).t()  # [H, I]
        assert torch.equal(value, dequantize_mxfp4(blocks[i], scales[i])), i
    assert experts.gate_up_proj.numel() == 0  # the dense stacks were never kept
    for use_kernel in (False, True):
        got = kvserve_logits(kept, IDS, 9, use_kernel)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_dequantizer_reads_what_the_checkpoint_holds(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path],
) -> None:
    """The repacked blocks: gguf's own MXFP4 dequantizer gives transformers' dequantized
    experts (so the writer's nibble order is GGUF's)."""
    _, _, dense, path = gpt_oss_gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors["blk.0.ffn_down_exps.weight"]
    assert t.tensor_type == T.MXFP4
    got = dequantize(t.data, t.tensor_type)  # [E, H, I]
    want = dense["model.layers.0.mlp.experts.down_proj"].transpose(1, 2).numpy()
    assert np.array_equal(got, want)


def _generate(path: Path, quantization: str | None) -> list[list[int]]:
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(path), quantization=quantization, max_model_len=64, **FAST)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": IDS[:9]}, {"prompt_token_ids": IDS[3:7]}],
                            params, use_tqdm=False)  # fmt: skip
    finally:
        llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_engine_greedy_tokens_equal_transformers(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LLM(model=file.gguf)`` dense and with ``quantization="gguf"``: transformers' greedy
    tokens (past the 8-token window)."""
    reference, _, _, path = gpt_oss_gguf
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    want = []
    for prompt in (IDS[:9], IDS[3:7]):
        with torch.no_grad():
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=0, eos_token_id=None)  # EOS too  # fmt: skip
        want.append(ids[0, len(prompt) :].tolist())
    assert len({t for w in want for t in w}) > 3  # not one repeated token
    assert _generate(path, None) == want
    assert _generate(path, "gguf") == want


def test_unsupported_gpt_oss_files_refused_by_name(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """A window-less file, or sliding layers with a RoPE base of their own, is refused."""
    _, folder, _, _ = gpt_oss_gguf
    from kvserve.model.gguf_metadata import read_hparams

    good = gguf.GGUFReader(write_gpt_oss_gguf(folder, tmp_path / "good.gguf"))
    assert read_hparams(good).extra["layer_types"] == ["sliding_attention", "full_attention"]
    for key, value, match in (
        ("gpt-oss.attention.sliding_window", None, "sliding_window"),
        ("gpt-oss.rope.freq_base_swa", 10000.0, "RoPE base"),
        ("gpt-oss.rope.scaling.yarn_ext_factor", 0.5, "yarn_ext_factor"),
    ):
        fields = dict(good.fields)
        if value is None:
            del fields[key]
        else:
            fields[key] = _float_field(key, value)
        reader = type("R", (), {"fields": fields, "tensors": good.tensors})()
        with pytest.raises(ValueError, match=match):
            read_hparams(reader)


def _float_field(key: str, value: float) -> gguf.ReaderField:
    """A float32 metadata field as ``GGUFReader`` gives one."""
    data = np.array([value], dtype=np.float32)
    return gguf.ReaderField(0, key, [data], [0], [gguf.GGUFValueType.FLOAT32])


def test_harmony_stop_tokens_end_generation(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """A gpt-oss file's vocabulary with harmony's tokens: generation stops on <|return|>,
    <|call|> and <|endoftext|> (eos first), not <|end|>, as llama.cpp and gpt-oss's own
    generation config; other architectures keep the file's one eos."""
    from dataclasses import replace

    from kvserve.model.gguf_metadata import eos_token_ids, read_hparams

    _, _, _, path = gpt_oss_gguf
    hp = read_hparams(gguf.GGUFReader(path))
    vocab = ["a", "<|endoftext|>", "<|end|>", "<|return|>", "b", "<|call|>", "<|start|>"]
    _write_gguf(tmp_path / "vocab.gguf", ARCH, lambda w: w.add_token_list(vocab))
    reader = gguf.GGUFReader(tmp_path / "vocab.gguf")
    assert eos_token_ids(reader, replace(hp, eos_token_id=3)) == [3, 1, 5]
    assert eos_token_ids(reader, replace(hp, eos_token_id=4)) == [4, 1, 3, 5]
    assert eos_token_ids(reader, replace(hp, architecture="qwen3moe", eos_token_id=3)) == 3
    out = convert_gguf(path, tmp_path / "out")  # the tiny vocabulary has none of them
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1]


def test_a_kept_head_is_never_read_densely(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file whose untied ``output.weight`` is Q8_0: with ``--quantization gguf`` the head is
    the file's Q8_0 (the logits of transformers' model holding those values), and the
    loader hands the model no dense head (a meta tensor: never dequantized nor allocated)."""
    from kvserve.model import loader

    reference, folder, _, _ = gpt_oss_gguf
    path = write_gpt_oss_gguf(folder, tmp_path / "q8-head.gguf", head=T.Q8_0)
    out = convert_gguf(path, tmp_path / "out")
    seen: dict[str, bool] = {}
    real = loader._iter_weights

    def spy(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for name, tensor in real(*args, **kwargs):  # type: ignore[arg-type]
            seen[name] = tensor.is_meta
            yield name, tensor

    monkeypatch.setattr(loader, "_iter_weights", spy)
    keep = QuantOptions(
        Quantization.GGUF, None, str(path), activations=QuantizedActivations.NONE, lm_head=None
    )  # the default
    model = load_model(out, torch.float32, "cpu", 64, quant=keep)
    assert seen["lm_head.weight"] is True and seen["model.embed_tokens.weight"] is False
    assert model.quant_report.lm_head == "Q8_0"  # type: ignore[attr-defined]
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    head = torch.from_numpy(dequantize(t.data, T.Q8_0).reshape(reference.lm_head.weight.shape))
    twin = type(reference)(reference.config).eval()
    twin.load_state_dict({**reference.state_dict(), "lm_head.weight": head})
    got = kvserve_logits(model, IDS, 9, False)
    torch.testing.assert_close(got, reference_logits(twin), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got, reference_logits(reference), atol=1e-4)  # Q8_0 mattered


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.bfloat16, marks=needs_a8), torch.float32], ids=str
)
def test_experts_run_table_codes_through_the_experts_op(
    gpt_oss_gguf: tuple[PreTrainedModel, Path, dict[str, torch.Tensor], Path],
    tmp_path: Path,
    dtype: torch.dtype,
) -> None:
    """Each kept MXFP4 expert streams 4-bit table codes with float16 scales (bf16 on
    AVX512-VNNI: the int8-activation kernel's records; float32: the weight-only kernel's
    codes), and the C++ experts op (one call per layer, the table flag in its records or
    offset) gives the PyTorch grouped path's outputs bit for bit, on a routing that leaves
    some experts without tokens and gives others several."""
    _, _, _, path = gpt_oss_gguf
    out = convert_gguf(path, tmp_path / "out")
    keep = QuantOptions(Quantization.GGUF, None, str(path), lm_head=None)
    model = load_model(out, dtype, "cpu", 64, fused_ops=True, quant=keep)
    experts = model.layers[1].mlp.experts
    assert experts.use_kernel and experts.kernel() is not None
    for layer in (*experts.q_gate_up, *experts.q_down):
        if dtype == torch.bfloat16:
            assert layer.code_bits == 4 and layer.scale_format == A8_TABLE | A8Scales.FLOAT16
        else:
            assert (layer.path, layer.code_bits, layer.offset) == ("kernel", 4, TABLE_OFFSET)
            assert layer.scales_t.dtype == torch.float16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, model.config.hidden_size, generator=gen).to(dtype)  # [T, H]
    ids = torch.tensor([[0, 1]] * 4 + [[2, 0], [1, 3], [0, 2], [3, 1], [0, 1]])  # [9, 2]
    weights = torch.rand(9, 2, generator=gen)
    fused = experts(x, weights, ids)
    experts.use_kernel = False
    assert torch.equal(experts(x, weights, ids).view(torch.uint8), fused.view(torch.uint8))
