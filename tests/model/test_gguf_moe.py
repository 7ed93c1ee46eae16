"""Mixture-of-experts GGUF files (``qwen2moe``, ``qwen3moe``, and ``llama`` with experts as
llama.cpp writes Mixtral), written with the ``gguf`` package as llama.cpp's converter writes
them (experts stacked ``[E, rows, cols]`` as ``ffn_{gate,up,down}_exps``, the router as
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
from safetensors.torch import load_file
from transformers import AutoConfig, PreTrainedModel

from kvserve.model.gguf_convert import convert_gguf
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
}
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


def write_moe_gguf(folder: Path, gguf_arch: str, path: Path) -> Path:
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
        if gguf_arch != "llama":
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if gguf_arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        add_tiny_tokenizer(w)
        for name, t in tensors.items():
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    return _write_gguf(path, gguf_arch, fill)


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, PreTrainedModel, Path, Path]:
    """(family, the original model, its saved folder, its F32 GGUF)."""
    family = request.param
    gguf_arch, _, overrides = ARCHS[family]
    folder = tmp_path_factory.mktemp(family)
    model = make_moe_model(family, folder, rms_norm_eps=2.0**-10, **overrides)
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


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(
    moe_family: tuple[str, PreTrainedModel, Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvserve import LLM, SamplingParams

    family, original, _, path = moe_family
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=str(path), **FAST)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.close()
    got = [list(o.outputs[0].token_ids) for o in outputs]
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = original.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0,
            )[0, len(prompt) :]  # fmt: skip
        assert tokens == want.tolist(), (family, prompt)
    assert len({t[0] for t in got}) > 1  # not one repeated token
