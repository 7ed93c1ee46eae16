"""Mixture-of-experts GGUF files (``qwen2moe``, ``qwen3moe``, ``olmoe``, and ``llama`` with
experts as llama.cpp writes Mixtral), written with the ``gguf`` package as llama.cpp's converter
writes them (experts stacked ``[E, rows, cols]`` as ``ffn_{gate,up,down}_exps``, the router as
``ffn_gate_inp``, Qwen2-MoE's shared expert as ``*_shexp``) from the tiny random models of
``tiny_moe``: the converted folder holds the original checkpoint's tensors exactly, under its
names, and kvserve's greedy tokens equal transformers'."""

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
from transformers import AutoConfig, PreTrainedModel

from kvserve.config import Quantization
from kvserve.model import moe
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.loader import load_model
from kvserve.moe.experts import FusedExperts
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.gguf_weights import GGUFLinears
from kvserve.quantization.qlinear import QuantLinear
from tests.model.test_gguf import _write_gguf, llama_cpp_permute
from tests.model.test_gguf_families import FAST
from tests.model.test_gguf_gemma_phi3 import PROMPTS, add_tiny_tokenizer
from tests.model.tiny_moe import make_moe_model

MAX_TOKENS = 16
# transformers' family -> (GGUF architecture, HF architecture); GGUF holds every layer sparse
# and no window (llama.cpp's graphs for these have none), so the tiny models drop theirs
ARCHS = {
    "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM", {"mlp_only_layers": []}),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM", {}),
    "mixtral": ("llama", "MixtralForCausalLM", {"sliding_window": None}),
    # llama.cpp's olmoe graph has no clip_qkv (its converter drops it), and its converter
    # writes an RMSNorm epsilon of 1e-5 whatever the config says (OlmoeModel)
    "olmoe": ("olmoe", "OlmoeForCausalLM", {"clip_qkv": None, "rms_norm_eps": 1e-5}),
}
EPS = 2.0**-10  # the tiny models' RMSNorm epsilon, where ARCHS does not name one
_ATTN = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp"}  # fmt: skip
# an expert's matrix (Qwen's names, then Mixtral's) -> llama.cpp's stacked tensor
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip


def to_gguf_tensors(state: dict[str, np.ndarray], gguf_arch: str, heads: tuple[int, int]) -> dict:
    """The checkpoint's tensors under llama.cpp's names, experts stacked; q/k rows permuted
    for ``llama`` files (``LlamaModel.modify_tensors``)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in state.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                 "lm_head.weight": "output"}[name] + ".weight"] = t  # fmt: skip
            continue
        _, _, layer, rest = name.split(".", 3)
        base, suffix = rest.rsplit(".", 1)
        if ".experts." in base:  # mlp.experts.3.gate_proj / block_sparse_moe.experts.3.w1
            _, expert, matrix = base.rsplit(".", 2)
            experts.setdefault(f"blk.{layer}.{_EXPERT[matrix]}.weight", {})[int(expert)] = t
            continue
        kind = _ATTN[base]
        if gguf_arch == "llama" and kind in ("attn_q", "attn_k"):
            t = llama_cpp_permute(t, heads[0] if kind == "attn_q" else heads[1])
        out[f"blk.{layer}.{kind}.{suffix}"] = t
    for name, parts in experts.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])  # [E, rows, cols]
    return out


def write_moe_gguf(
    folder: Path, gguf_arch: str, path: Path, types: dict[str, T] | None = None
) -> Path:
    """The checkpoint in ``folder`` as llama.cpp writes it; ``types``: llama.cpp kind -> a type
    gguf-py quantizes to (the rest F32)."""
    c = json.loads((folder / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    tensors = to_gguf_tensors(state, gguf_arch, (heads, kv))

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(c["hidden_size"])
        w.add_block_count(c["num_hidden_layers"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
        if c.get("head_dim"):
            w.add_key_length(c["head_dim"])
            w.add_value_length(c["head_dim"])
        w.add_expert_count(c.get("num_experts") or c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        if gguf_arch in ("qwen2moe", "qwen3moe"):  # olmoe's: feed_forward_length
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if gguf_arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        add_tiny_tokenizer(w)
        for name, t in tensors.items():
            qtype = (types or {}).get(name.split(".")[-2])
            t = np.ascontiguousarray(t, dtype=np.float32)
            if qtype is None:
                w.add_tensor(name, t)
            else:  # quantized along the rows' last axis, experts stacked as [E, rows, bytes]
                w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)

    return _write_gguf(path, gguf_arch, fill)


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, PreTrainedModel, Path, Path]:
    """(family, the original model, its saved folder, its F32 GGUF)."""
    family = request.param
    gguf_arch, _, overrides = ARCHS[family]
    folder = tmp_path_factory.mktemp(family)
    model = make_moe_model(family, folder, **{"rms_norm_eps": EPS, **overrides})
    path = write_moe_gguf(folder, gguf_arch, folder.parent / f"{family}.gguf")
    return family, model, folder, path


def test_converted_folder_equals_the_checkpoint(
    moe_family: tuple[str, PreTrainedModel, Path, Path], tmp_path: Path
) -> None:
    family, original, folder, path = moe_family
    out = convert_gguf(path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHS[family][1]]
    ref, got = original.config, AutoConfig.from_pretrained(str(out))
    keys = ("num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
            "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim")  # fmt: skip
    for key in (k for k in keys if hasattr(ref, k)):
        want = getattr(ref, key)
        if key == "head_dim" and want is None:  # Mixtral's default: hidden / heads
            want = ref.hidden_size // ref.num_attention_heads
        assert getattr(got, key) == want, key
    ours = load_file(str(out / "model.safetensors"))
    want = load_file(str(folder / "model.safetensors"))
    assert set(ours) == set(want)
    for name, tensor in ours.items():
        assert torch.equal(tensor, want[name]), name  # q/k unpermuted for the llama file


def _generate(path: Path, quantization: str | None = None) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``PROMPTS``, and how many layers were kept quantized."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(path), quantization=quantization, **FAST)
    try:
        report = getattr(llm.engine.runner.model, "quant_report", None)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outputs], 0 if report is None else report.layers


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(
    moe_family: tuple[str, PreTrainedModel, Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    family, original, _, path = moe_family
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got, _ = _generate(path)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = original.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0,
            )[0, len(prompt) :]  # fmt: skip
        assert tokens == want.tolist(), (family, prompt)
    assert len({t[0] for t in got}) > 1  # not one repeated token


# experts, attention and the shared expert in the types gguf-py quantizes to, mixed inside the
# fused gate/up and q/k/v
TYPES = {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q5_0,
         "attn_q": T.Q5_1, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
         "ffn_gate_shexp": T.Q8_0, "ffn_up_shexp": T.Q8_0, "ffn_down_shexp": T.Q4_0}  # fmt: skip


@pytest.fixture(scope="module")
def quantized(
    moe_family: tuple[str, PreTrainedModel, Path, Path],
) -> tuple[str, PreTrainedModel, Path]:
    family, model, folder, _ = moe_family
    path = folder.parent / f"{family}-mixed.gguf"
    return family, model, write_moe_gguf(folder, ARCHS[family][0], path, TYPES)


def test_experts_equal_gguf_dequantizer(quantized: tuple[str, PreTrainedModel, Path]) -> None:
    """Each expert's gate/up and down hold gguf's values of its rows of the stacked tensors."""
    family, model, path = quantized
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    source = GGUFLinears(path, model.config)
    experts = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    assert sorted(source.experts) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    # every expert matrix comes from the blocks: the loader reads none of them densely
    assert len({n for n in source.checkpoint_names if ".experts." in n}) == 2 * experts * 3
    for layer in range(2):

        def stacked(kind: str, e: int, layer: int = layer) -> np.ndarray:
            t = tensors[f"blk.{layer}.{kind}.weight"]
            return dequantize(t.data, t.tensor_type)[e]  # [E, rows, cols] -> expert e

        for e in range(experts):
            gate_up = np.concatenate([stacked("ffn_gate_exps", e), stacked("ffn_up_exps", e)])
            got = source.take_expert(f"layers.{layer}.mlp.experts", e, "gate_up_proj")
            assert torch.equal(got.dequantize(torch.float32), torch.from_numpy(gate_up))
            got = source.take_expert(f"layers.{layer}.mlp.experts", e, "down_proj")
            want = torch.from_numpy(stacked("ffn_down_exps", e))
            assert torch.equal(got.dequantize(torch.float32), want)


def test_experts_built_side_by_side_equal_one_at_a_time(
    quantized: tuple[str, PreTrainedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader builds a layer's experts on ``load_workers()`` threads: the same layers,
    in expert order, byte for byte, and the same report as one thread builds."""
    _, _, path = quantized
    out = convert_gguf(path, tmp_path / "out")
    keep = QuantOptions(Quantization.GGUF, None, str(path), lm_head=None)
    built = {}
    for workers in (1, 3):
        monkeypatch.setattr(moe, "load_workers", lambda w=workers: w)
        model = load_model(out, torch.float32, "cpu", 64, quant=keep)
        report = model.quant_report  # type: ignore[attr-defined]
        layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
        built[workers] = (
            [_kernel_state(q) for m in layers for q in (*m.q_gate_up, *m.q_down)],
            (report.layers, report.weight_bytes, report.dense_bytes),
        )
        assert all(isinstance(q, QuantLinear) for m in layers for q in m.q_down)
    (one, one_report), (three, three_report) = built[1], built[3]
    assert len(one) == len(three) > 0 and one_report == three_report
    for a, b in zip(one, three, strict=True):
        assert a[0] == b[0] and len(a[1]) == len(b[1])
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def _kernel_state(q: QuantLinear) -> tuple[tuple[str, int, int], list[torch.Tensor]]:
    """What a layer's kernel reads: its path, offset and scale format, and its buffers (the
    int8-activation records hold the scales; the float kernel has them apart)."""
    tensors = [q.codes] if q.path == "a8" else [q.codes, q.scales_t, q.zeros_t]
    return (q.path, q.offset, q.scale_format), tensors


@pytest.mark.slow
def test_experts_kept_quantized_give_the_dequantized_tokens(
    quantized: tuple[str, PreTrainedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization gguf`` on an MoE file: attention, the shared expert and every expert
    on the quantized kernels with the file's own values, the tokens of the dequantized file."""
    family, model, path = quantized
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    dense, _ = _generate(path)
    tokens, layers = _generate(path, "gguf")
    assert tokens == dense
    experts = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    shared = 2 if family == "qwen2_moe" else 0  # its gate_up and down
    assert layers == 2 * (2 + 2 * experts + shared)  # per layer: qkv, o, experts' gate_up/down
    assert len({t[0] for t in dense}) > 1
