"""Tiny random transformers models of many architectures, saved as model folders with a
byte-level tokenizer (for the transformers backend's tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

VOCAB = 260  # 256 byte tokens, <|endoftext|> (256) and a few spare ids
EOS = 256
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": EOS,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
}
MHA = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}

# architecture -> (config class, its arguments); each runs through the transformers backend.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**COMMON, "rope_theta": 5000.0}),
    "qwen3": ("Qwen3Config", {**COMMON, "head_dim": 16}),
    "phi3": ("Phi3Config", {**COMMON, "sliding_window": None}),
    "olmo2": ("Olmo2Config", COMMON),
    "granite": (
        "GraniteConfig",
        {
            **COMMON,
            "logits_scaling": 4.0,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
        },
    ),
    "gpt_neox": ("GPTNeoXConfig", {**MHA, "rotary_pct": 0.5, "use_parallel_residual": True}),
    "gemma": ("GemmaConfig", {**COMMON, "head_dim": 16}),
    "cohere": ("CohereConfig", {**COMMON, "logit_scale": 0.5}),
    "gptj": (
        "GPTJConfig",
        {
            "vocab_size": VOCAB,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "rotary_dim": 8,
            "n_positions": 512,
            "bos_token_id": EOS,
            "eos_token_id": EOS,
            "pad_token_id": EOS,
        },
    ),
    "starcoder2": ("Starcoder2Config", {**COMMON, "sliding_window": None}),
    # Attention soft-capping (1.0: small enough to bend these scores), alternating 8-token
    # windows (shorter than prompt + output) and soft-capped final logits.
    "gemma2": (
        "Gemma2Config",
        {
            **COMMON,
            "head_dim": 16,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 3.0,
            "sliding_window": 8,
        },
    ),
    # Gemma 3: 8-token windows on all but every 6th layer, soft-capped logits.
    "gemma3_text": (
        "Gemma3TextConfig",
        {**COMMON, "head_dim": 16, "final_logit_softcapping": 3.0, "sliding_window": 8},
    ),
    # Qwen3 sliding from layer 1 on (max_window_layers 1) over 8 tokens
    "qwen3_window": (
        "Qwen3Config",
        {
            **COMMON,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    "mistral_window": ("MistralConfig", {**COMMON, "sliding_window": 8}),
    "phi": ("PhiConfig", {**MHA, "partial_rotary_factor": 0.5}),
    "gpt2": (  # learned absolute positions: position_ids are kvserve's positions
        "GPT2Config",
        {
            "vocab_size": VOCAB,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 512,
            "bos_token_id": EOS,
            "eos_token_id": EOS,
            "pad_token_id": EOS,
        },
    ),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte plus ``<|endoftext|>`` (id 256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    cls_name, kwargs = CONFIGS[arch]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def save_model(config: transformers.PretrainedConfig, path: Path) -> PreTrainedModel:
    """A seeded random model of ``config``'s causal-LM class, saved to ``path`` with the
    byte tokenizer; returned in float32, eval mode, with the default (sdpa) attention."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


def make_tiny_hf_model(arch: str, path: Path, **overrides: Any) -> PreTrainedModel:
    return save_model(make_config(arch, **overrides), path)
