"""A GGUF's metadata as Hugging Face files: the model sizes (``read_hparams``), the
``config.json`` contents of the native family it maps to and the tokenizer (with its chat
template). Used by ``gguf_convert``.

Each GGUF ``general.architecture`` maps to the transformers class kvserve runs natively, with
the settings llama.cpp's converter drops or its runtime hard-codes filled in as llama.cpp's
``src/llama-model.cpp`` fills them: Gemma 2's and 3's window pattern (every 2nd / 6th layer
global, transformers' default ``layer_types`` too), Gemma 3's local RoPE base
(``rope.freq_base_swa``, else 10000), the ``query_pre_attn_scalar`` (head_dim, but hidden /
heads for the 27B shapes: 46 / 62 layers).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from gguf import ReaderField, ReaderTensor

from kvserve.model.gguf_rope import llama3_rope_scaling

# GGUF `general.architecture` -> the transformers architecture its folder is written as (all
# native in kvserve). They use llama.cpp's tensor names (gguf.constants.MODEL_TENSORS); qwen2
# adds q/k/v biases, qwen3 and gemma3 per-head q/k norms, gemma2/3 sandwich norms, phi3 fuses
# q/k/v and gate/up (gguf_convert). A phi3 file with a sliding window is written as Mistral
# (Llama with a window on every layer, as transformers' Phi3 applies it); a llama file with
# experts (`llama.expert_count`) as Mixtral. olmoe's q/k norms span the whole projection.
# gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): attention sinks, biases, a biased router, every
# 2nd layer global, YaRN, its experts usually MXFP4 blocks (kept by --quantization gguf).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "LlamaForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# MoE architectures whose files must name their experts (`{arch}.expert_count`)
_MOE_ARCHS = ("qwen2moe", "qwen3moe", "olmoe", "gpt-oss")
GPT_OSS = "gpt-oss"
# llama.cpp's YaRN betas when the file names none (llama_context's cparams defaults)
_YARN_BETAS = (32.0, 1.0)
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# llama.cpp's gemma2 / gemma3 27B shapes (by layer count) scale queries by hidden / heads
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's rope_freq_base_train_swa when the file has no gemma3.rope.freq_base_swa
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


class GGUFLike(Protocol):
    """What is read here: a ``gguf.GGUFReader``, or ``gguf_names.GGUFFiles`` (shards)."""

    fields: Mapping[str, ReaderField]
    tensors: list[ReaderTensor]


@dataclass(frozen=True)
class LlamaHParams:
    """The model sizes read from a GGUF's ``{arch}.*`` metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    architecture: str = "llama"  # the GGUF's general.architecture (a key of ARCHITECTURES)
    # the family's own config fields (sliding_window, soft-caps, query_pre_attn_scalar, ...)
    extra: dict[str, Any] = field(default_factory=dict)


def _field(reader: GGUFLike, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, list), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader: GGUFLike, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return value


def _vocab_size(reader: GGUFLike) -> int:
    """The token count: the tokenizer's, else the embedding's rows (a file of weights only)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one entry per token; no need to decode them all
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # ggml order: [hidden, vocab]
    raise ValueError("GGUF has no vocab_size, tokenizer.ggml.tokens nor token_embd.weight")


def read_architecture(reader: GGUFLike) -> str:
    """The GGUF's ``general.architecture``; ValueError if this converter cannot handle it."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: kvserve can only convert "
            f"{sorted(SUPPORTED_ARCHITECTURES)} models"
        )
    return str(arch)


def read_hparams(reader: GGUFLike) -> LlamaHParams:
    """Read the Llama sizes from the GGUF metadata (``{arch}.`` keys) and validate them."""
    arch = read_architecture(reader)
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names and arch != "llama":
        raise ValueError(f"{arch} GGUF with rope_freqs.weight (rope frequency factors) is not "
                         "supported; only llama files' Llama 3 scaling is")  # fmt: skip
    if "rope_factors_long.weight" in tensor_names:
        raise ValueError(f"{arch} GGUF uses LongRoPE (rope_factors_long.weight); not supported")

    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv_head = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    if arch in ("qwen2", "qwen2moe", "olmoe") and head_dim != hidden // n_head:
        # Qwen2Config and OlmoeConfig have no head_dim: it is always hidden / heads.
        raise ValueError(f"{arch} GGUF with head dim {head_dim} != {hidden} / {n_head}")
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        # HF Llama rotates the whole head; partial rotary would silently give wrong outputs.
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) unsupported")

    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = _vocab_size(reader)

    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = _llama3_scaling(reader, rope_theta, head_dim)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if rope_scaling is not None and scaling_type not in (None, "none"):
        raise ValueError(f"GGUF has both rope_freqs.weight and rope scaling {scaling_type!r}")
    if scaling_type not in (None, "none"):
        rope_scaling = _rope_scaling(reader, arch, str(scaling_type))

    def optional_int(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    extra = {**_family_extra(reader, arch, hidden // n_head, head_dim), **_moe_extra(reader, arch)}
    ffn = _field(reader, f"{arch}.feed_forward_length") or extra.get("moe_intermediate_size")
    if arch == GPT_OSS:  # its experts' size (llama.cpp's graph reads this key only)
        ffn = _require(reader, f"{arch}.expert_feed_forward_length")
    if ffn is None:
        raise ValueError(f"GGUF metadata is missing required key '{arch}.feed_forward_length'")
    return LlamaHParams(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        head_dim=head_dim,
        max_position_embeddings=int(_require(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # llama.cpp omits output.weight exactly when the LM head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
        pad_token_id=optional_int("tokenizer.ggml.padding_token_id"),
        architecture=arch,
        extra=extra,
    )


def _rope_scaling(reader: GGUFLike, arch: str, scaling_type: str) -> dict[str, Any]:
    """``{arch}.rope.scaling.*`` as transformers' ``rope_scaling``: linear, or YaRN with
    llama.cpp's defaults for what the file leaves out. gpt-oss's YaRN keeps its correction
    range unrounded (``truncate: False``, as OpenAI's config and transformers compute it;
    llama.cpp's ``ggml_rope_yarn_corr_dims`` rounds it outwards, a small difference on the
    few frequencies at its edges); the other families round it, as both do."""
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None or scaling_type not in ("linear", "yarn"):
        raise ValueError(f"unsupported rope scaling {scaling_type!r} in GGUF")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    for key in ("yarn_ext_factor", "yarn_attn_factor", "attn_factor", "yarn_log_multiplier"):
        value = _field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None and float(value) not in (1.0, -1.0):  # -1: llama.cpp's "unset"
            raise ValueError(f"GGUF YaRN with rope.scaling.{key} {value} is not supported")
    fast, slow = _YARN_BETAS
    return {
        "rope_type": "yarn", "factor": float(factor),
        "original_max_position_embeddings": int(
            _require(reader, f"{arch}.rope.scaling.original_context_length")),
        "beta_fast": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", fast)),
        "beta_slow": float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", slow)),
        "truncate": arch != GPT_OSS,
    }  # fmt: skip


def _llama3_scaling(reader: GGUFLike, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Llama 3's rope scaling solved from ``rope_freqs.weight`` (``gguf_rope``), or None."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    # the unscaled frequencies as llama.cpp's converter computes them (float32)
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponent)
    return llama3_rope_scaling(np.asarray(tensor.data, dtype=np.float32).reshape(-1), inv_freq)


def _family_extra(reader: GGUFLike, arch: str, hidden_per_head: int, head_dim: int) -> dict:
    """The config fields only ``arch``'s family has, from the file or as llama.cpp sets them."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    if arch == "phi3":
        return {} if window is None else {"sliding_window": window}
    if arch == GPT_OSS:
        return _gpt_oss_extra(reader, window)
    if arch not in ("gemma2", "gemma3"):
        return {}
    layers = int(_require(reader, f"{arch}.block_count"))
    big = layers == _GEMMA_27B_LAYERS[arch]
    extra: dict[str, Any] = {
        "sliding_window": window,
        "query_pre_attn_scalar": hidden_per_head if big else head_dim,
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = _field(reader, f"{arch}.attn_logit_softcapping")
    else:  # newer llama.cpp converters write the local base (Ollama's its own key); older
        # files leave it implied
        base = _field(reader, f"{arch}.rope.freq_base_swa")
        base = _field(reader, f"{arch}.rope.local.freq_base", _GEMMA3_LOCAL_ROPE_BASE) \
            if base is None else base  # fmt: skip
        extra["rope_local_base_freq"] = float(base)
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:  # else transformers' default, as llama.cpp's runtime assumes it
        extra["layer_types"] = _layer_types(pattern, layers)
    return extra


def _gpt_oss_extra(reader: GGUFLike, window: int | None) -> dict[str, Any]:
    """gpt-oss's window and which layers slide (the file's pattern, else every 2nd layer
    global, as llama.cpp's ``load_swa_pattern(ml, 2)``); one RoPE base for both kinds."""
    arch = GPT_OSS
    if window is None:
        raise ValueError(f"GGUF metadata is missing required key '{arch}.attention.sliding_window'")
    base, swa_base = (_field(reader, f"{arch}.rope.{k}") for k in ("freq_base", "freq_base_swa"))
    if swa_base is not None and float(swa_base) != float(base or 10000.0):
        raise ValueError(f"gpt-oss GGUF with its own sliding layers' RoPE base ({swa_base}) is "
                         "not supported")  # fmt: skip
    layers = int(_require(reader, f"{arch}.block_count"))
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 2)
    return {"sliding_window": window, "layer_types": _layer_types(pattern, layers)}


def _layer_types(pattern: Any, layers: int) -> list[str]:
    """``attention.sliding_window_pattern`` as ``layer_types``: a bool per layer (True:
    sliding), as llama.cpp's and Ollama's newer converters write it, or every n-th global."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {layers} "
                             "layers")  # fmt: skip
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _moe_extra(reader: GGUFLike, arch: str) -> dict[str, Any]:
    """Expert counts and sizes; top-k renormalisation as llama.cpp's graphs do it (qwen3moe
    and llama-with-experts renormalise, qwen2moe and olmoe not) unless ``expert_weights_norm``
    says."""
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        if arch in _MOE_ARCHS:
            raise ValueError(f"GGUF metadata is missing required key '{arch}.expert_count'")
        return {}
    if arch not in ("llama", *_MOE_ARCHS):
        raise ValueError(f"{arch} GGUF with experts ({arch}.expert_count) is not supported")
    used = int(_require(reader, f"{arch}.expert_used_count"))
    if arch == GPT_OSS:  # softmax over the top-k logits: llama.cpp's SOFTMAX_WEIGHT gating
        return {"num_local_experts": int(experts), "num_experts_per_tok": used}
    if arch == "llama":  # Mixtral
        return {"num_local_experts": int(experts), "num_experts_per_tok": used}
    norm = _field(reader, f"{arch}.expert_weights_norm")
    if arch == "olmoe":  # experts of feed_forward_length; llama.cpp's graph has no clip_qkv
        return {"num_experts": int(experts), "num_experts_per_tok": used,
                "norm_topk_prob": bool(norm), "clip_qkv": None}  # fmt: skip
    extra = {
        "num_experts": int(experts), "num_experts_per_tok": used,
        "moe_intermediate_size": int(_require(reader, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": arch == "qwen3moe" if norm is None else bool(norm),
        "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
    }  # fmt: skip
    if arch == "qwen2moe":
        key = f"{arch}.expert_shared_feed_forward_length"
        extra["shared_expert_intermediate_size"] = int(_require(reader, key))
    return extra


# harmony's end-of-generation tokens: gpt-oss's own generation_config.json lists them, and
# llama.cpp's vocabulary (llama-vocab.cpp) ends generation on them in gpt-oss files; not on
# <|end|>, which closes a message (the analysis channel) the model goes on after
_GPT_OSS_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")


def eos_token_ids(reader: GGUFLike, hp: LlamaHParams) -> int | list[int] | None:
    """``generation_config.json``'s ``eos_token_id``: the file's eos, and for gpt-oss every
    harmony stop token its vocabulary has (eos first)."""
    tokens = _field(reader, "tokenizer.ggml.tokens") if hp.architecture == GPT_OSS else None
    if hp.eos_token_id is None or tokens is None:
        return hp.eos_token_id
    stops = [i for i, t in enumerate(tokens) if t in _GPT_OSS_STOPS]
    return list(dict.fromkeys([hp.eos_token_id, *stops]))


def hf_architecture(hp: LlamaHParams) -> str:
    """The transformers class ``hp``'s folder is written for."""
    if hp.architecture == "phi3" and hp.extra.get("sliding_window"):
        return "MistralForCausalLM"
    if hp.architecture == "llama" and hp.extra.get("num_local_experts"):
        return "MixtralForCausalLM"
    return ARCHITECTURES[hp.architecture]


def _config_class(hp: LlamaHParams) -> tuple[type, dict[str, Any]]:
    """The transformers config class for ``hp``'s family and the keyword arguments only it
    takes."""
    import transformers

    arch = hp.architecture
    if arch == "qwen2":
        # q/k/v biases are built in; head_dim is always hidden / heads (read_hparams checks);
        # no sliding window (llama.cpp's qwen2 graph has none either).
        return transformers.Qwen2Config, {"use_sliding_window": False}
    if arch == "qwen3":
        # llama.cpp's qwen3 graph has no attention biases (no attn_q.bias tensors exist).
        extra = {"head_dim": hp.head_dim, "attention_bias": False, "use_sliding_window": False}
        return transformers.Qwen3Config, extra
    if arch in GEMMA_ARCHS:
        classes = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
                   "gemma3": transformers.Gemma3TextConfig}  # fmt: skip
        # llama.cpp's gemma graphs: GELU (tanh) GeGLU, no attention biases
        own = {k: v for k, v in hp.extra.items() if k != "rope_local_base_freq"}  # in rope
        extra = {"head_dim": hp.head_dim, "hidden_activation": "gelu_pytorch_tanh",
                 "attention_bias": False, **own}  # fmt: skip
        return classes[arch], extra
    if arch == "qwen2moe":
        return transformers.Qwen2MoeConfig, dict(hp.extra)  # q/k/v biases built in
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig, {"head_dim": hp.head_dim, "attention_bias": False,
                                             **hp.extra}  # fmt: skip
    if arch == "olmoe":  # whole-projection q/k norms and no biases are built in
        return transformers.OlmoeConfig, dict(hp.extra)
    if arch == GPT_OSS:  # biases everywhere; llama.cpp's SwiGLU alpha and limit are the
        # config's defaults (1.702, 7.0: hard-coded in its graph)
        return transformers.GptOssConfig, {"head_dim": hp.head_dim, "attention_bias": True,
                                           **hp.extra}  # fmt: skip
    if hf_architecture(hp) == "MistralForCausalLM":
        return transformers.MistralConfig, {"head_dim": hp.head_dim, **hp.extra}
    if hf_architecture(hp) == "MixtralForCausalLM":  # no window: llama.cpp's llama graph
        return transformers.MixtralConfig, {"head_dim": hp.head_dim, "sliding_window": None,
                                            **hp.extra}  # fmt: skip
    return transformers.LlamaConfig, {"head_dim": hp.head_dim}


def _rope_parameters(hp: LlamaHParams) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``; Gemma 3's per layer type (linear scaling on the
    global layers only, as llama.cpp scales only those)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": hp.rope_theta}
    if hp.rope_scaling is not None:
        rope = {**hp.rope_scaling, "rope_theta": hp.rope_theta}
    if hp.architecture != "gemma3":
        return rope
    local = {"rope_type": "default", "rope_theta": hp.extra["rope_local_base_freq"]}
    return {"sliding_attention": local, "full_attention": rope}


def build_config_dict(hp: LlamaHParams) -> dict[str, Any]:
    """The ``config.json`` contents for ``hp``, validated by its family's transformers config
    (``LlamaConfig``, ``Qwen2Config``, ``Gemma2Config``, ...)."""
    config_class, extra = _config_class(hp)
    config = config_class(
        vocab_size=hp.vocab_size,
        hidden_size=hp.hidden_size,
        intermediate_size=hp.intermediate_size,
        num_hidden_layers=hp.num_hidden_layers,
        num_attention_heads=hp.num_attention_heads,
        num_key_value_heads=hp.num_key_value_heads,
        max_position_embeddings=hp.max_position_embeddings,
        rms_norm_eps=hp.rms_norm_eps,
        rope_parameters=_rope_parameters(hp),
        tie_word_embeddings=hp.tie_word_embeddings,
        bos_token_id=hp.bos_token_id,
        eos_token_id=hp.eos_token_id,
        pad_token_id=hp.pad_token_id,
        architectures=[hf_architecture(hp)],
        dtype="float32",
        **extra,
    )
    data = config.to_dict()
    # Classification-head label maps are meaningless for a causal LM; keep config.json readable.
    data.pop("id2label", None)
    data.pop("label2id", None)
    # transformers 5 stores rope settings only under `rope_parameters`; the flat keys keep the
    # folder readable by older transformers and by code that reads config.json directly.
    if hp.architecture != "gemma3":
        data["rope_theta"] = hp.rope_theta
        if hp.rope_scaling is not None:
            data["rope_scaling"] = dict(hp.rope_scaling)
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _header_reader_for_transformers() -> Iterator[None]:
    """transformers' GGUF tokenizer builder parses the file with ``gguf.GGUFReader``, which it
    imports from the package when called: for that call it gets ``gguf_names.HeaderReader``
    (the same fields, 3x faster on a large vocabulary: a Qwen3-0.6B GGUF's first start,
    which converts it once, spent 10 of its 25 s there)."""
    import gguf

    from kvserve.model.gguf_names import HeaderReader

    original = gguf.GGUFReader
    gguf.GGUFReader = HeaderReader  # type: ignore[misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


# llama.cpp's pre-tokenizer names (``tokenizer.ggml.pre``) -> how their split regex cuts
# "12345" (llama-vocab.cpp: \p{N}{1,3} for gpt-4o, gpt-oss's, and llama3's; \p{N} for qwen2's).
# A transformers release that lacks a name's split builds GPT-2's (\p{N}+: one piece, and
# other rules differ too): every number, and whatever else those rules cut differently,
# becomes other tokens than the model was trained on, with no error anywhere.
_DIGIT_SPLITS: dict[str, list[str]] = {
    "gpt-4o": ["123", "45"],
    "llama-bpe": ["123", "45"],
    "llama3": ["123", "45"],
    "qwen2": ["1", "2", "3", "4", "5"],
}


def check_pre_tokenizer(tokenizer: Any, pre: str | None) -> None:
    """Refuse a tokenizer built from a GGUF whose ``pre`` split transformers did not apply
    (``_DIGIT_SPLITS``; names not listed there are left to transformers)."""
    want = _DIGIT_SPLITS.get(pre or "")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if want is None or backend is None:
        return
    splitter = backend.pre_tokenizer
    got = [piece for piece, _ in splitter.pre_tokenize_str("12345")] if splitter else ["12345"]
    if got != want:
        import transformers

        raise ValueError(
            f"this GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) was not applied by "
            f"transformers {transformers.__version__}: '12345' splits as {got}, the model's "
            f"own rule gives {want}, so its prompts would become tokens it was not trained "
            "on. Upgrade transformers to a release whose GGUF tokenizer builder applies "
            "this name (5.24 does)"
        )


def write_tokenizer(gguf_path: Path, reader: GGUFLike, out_dir: Path) -> None:
    """Rebuild the tokenizer from the GGUF metadata and save it (with chat template) to out_dir."""
    from transformers import AutoTokenizer, GemmaTokenizer, PreTrainedTokenizerFast

    # A local folder + gguf_file never touches the hub; transformers converts the GGUF vocab,
    # merges and special tokens into a fast tokenizer and copies the chat template over.
    arch = read_architecture(reader)
    # transformers' AutoTokenizer refuses a GGUF whose architecture its model loader lacks
    # (gemma 1, olmoe), though its GGUF tokenizer builder takes any: name the class for those.
    tokenizer_class = {"gemma": GemmaTokenizer, "olmoe": PreTrainedTokenizerFast,
                       GPT_OSS: PreTrainedTokenizerFast}.get(arch, AutoTokenizer)  # fmt: skip
    with _header_reader_for_transformers():
        tokenizer = tokenizer_class.from_pretrained(str(gguf_path.parent),
                                                    gguf_file=gguf_path.name)  # fmt: skip
    check_pre_tokenizer(tokenizer, _field(reader, "tokenizer.ggml.pre"))
    # Pin eos to the GGUF's own eos id (`<|im_end|>` for SmolLM2-Instruct): generation stops on it.
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    if tokens is not None and eos_id is not None and tokenizer.eos_token != tokens[int(eos_id)]:
        tokenizer.eos_token = tokens[int(eos_id)]
    # Without this the tokenizer reports an effectively infinite max length; the context length
    # is the real limit, and servers use model_max_length to reject over-long prompts.
    context = _field(reader, f"{arch}.context_length")
    if context is not None:
        tokenizer.model_max_length = int(context)
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))

    # Re-read what was written: a tokenizer that loses its chat template or eos on the round trip
    # would break chat completions far from here, so fail the conversion instead.
    saved = AutoTokenizer.from_pretrained(str(out_dir))
    if template is not None and saved.chat_template != template:
        raise RuntimeError("the chat template did not survive saving the tokenizer")
    if eos_id is not None and saved.eos_token_id != int(eos_id):
        raise RuntimeError(f"saved tokenizer eos id {saved.eos_token_id} != GGUF eos id {eos_id}")
