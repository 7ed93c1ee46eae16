"""Tiny random Qwen3, Mistral (windowed) and Gemma 1/2/3 (text) models, saved as Hugging
Face folders, and the plain prefill/decode drive of a kvserve model the model tests compare
with transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.model.base import ForwardBatch
from kvserve.model.llama import LlamaForCausalLM
from kvserve.worker.inputs import allocate_kv_caches, build_metadata
from tests.engine.utils import TINY

NATIVE_ARCHS = ("qwen3", "mistral", "gemma", "gemma2", "gemma3")
# Smaller than most prompts plus their outputs, so the sliding layers really drop keys.
WINDOW = 6
MISTRAL_WINDOW = 8  # Mistral slides on every layer
# head_dim 32 with hidden 64 and 4 heads: q is 128 wide, unlike hidden (as in Qwen3/Gemma).
# Eager attention: the reference for soft-capping (SDPA has none).
BASE = {**TINY, "head_dim": 32, "attn_implementation": "eager"}


def native_config(arch: str, **overrides: object) -> Qwen3Config | MistralConfig | GemmaConfig:
    """The tiny config of ``arch``: windows on some layers, soft-caps small enough to bite,
    Gemma 3's local and global RoPE with different bases (and linear scaling on global)."""
    if arch == "qwen3":
        # Layers from max_window_layers on slide: layer 0 full, layer 1 windowed.
        kw = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
        return Qwen3Config(**{**BASE, **kw, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**BASE, "sliding_window": MISTRAL_WINDOW, **overrides})
    if arch == "gemma":
        return GemmaConfig(**{**BASE, **overrides})
    gemma23 = {"query_pre_attn_scalar": 24, "sliding_window": WINDOW}
    if arch == "gemma2":
        # Default layer_types alternate: layer 0 sliding, layer 1 full.
        kw = {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0}
        return Gemma2Config(**{**BASE, **gemma23, **kw, **overrides})
    if arch == "gemma3":
        kw = {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            "final_logit_softcapping": 4.0,
        }
        return Gemma3TextConfig(**{**BASE, **gemma23, **kw, **overrides})
    raise ValueError(arch)


_CLASSES = {
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def make_native_model(arch: str, path: Path, **overrides: object) -> PreTrainedModel:
    """A random tiny model of ``arch`` saved to ``path``, float32. Norm weights are random
    too (transformers initialises Gemma's to 0 and Qwen3's to 1, which would hide a wrong
    ``1 + w`` or a missing q/k norm)."""
    torch.manual_seed(0)
    model = _CLASSES[arch](native_config(arch, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def kvserve_logits(
    model: LlamaForCausalLM, ids: list[int], prefill: int, use_kernel: bool
) -> torch.Tensor:
    """Logits ``[len(ids) - prefill + 1, V]``: one prefill of the first ``prefill`` tokens
    (its last row), then one decode step per remaining token, through blocks of 4."""
    bs, cpu = 4, torch.device("cpu")
    blocks = list(range(-(-len(ids) // bs)))
    kv = allocate_kv_caches(model, len(blocks), bs, model.embed_tokens.weight.dtype, cpu)
    rows = [(0, prefill)] + [(p, 1) for p in range(prefill, len(ids))]
    backend = (CpuKernelBackend if use_kernel else TorchSDPABackend)(cpu)
    out = []
    for start, n in rows:
        md, pos = build_metadata([(blocks, start, n)], bs, cpu)
        md = backend.build_metadata(md)
        hidden = model(ForwardBatch(torch.tensor(ids[start : start + n]), pos, kv, md, backend))
        out.append(model.compute_logits(hidden[-1:]))
    return torch.cat(out)
