"""Tiny random mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss) saved
as Hugging Face folders with transformers' own config classes and ``save_pretrained``: 2
layers, hidden 64, 4-8 experts, each family's peculiarities switched on where they can bite.
gpt-oss (``GPT_OSS``) is not in ``MOE_ARCHS``: its tests are its own (``test_gpt_oss.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from tests.engine.utils import TINY

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
WINDOW = 8  # Mixtral slides on every layer; shorter than most prompts plus outputs

BASE = {**TINY, "attn_implementation": "eager", "num_experts_per_tok": 2}
CONFIGS: dict[str, tuple[str, str, dict[str, object]]] = {
    # layer 0 dense (mlp_only_layers), layer 1 sparse: 4 experts of 32 plus a gated shared
    # expert of 64; q/k/v bias; no renormalisation (the family's default).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [0],
    }),
    # per-head q/k norms, head_dim 32 (q 128 wide), 8 experts, renormalised top-2
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "moe_intermediate_size": 32, "head_dim": 32, "norm_topk_prob": True,
    }),
    # 4 experts of 128 (intermediate_size), an 8-token window on every layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "sliding_window": WINDOW,
    }),
    # whole-projection q/k norms, q/k/v clamped at 2 (random norm weights make it bite)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_experts": 8, "intermediate_size": 32, "clip_qkv": 2.0,
    }),
    # layer 0 sliding (8 keys), layer 1 full; YaRN (x8 over 64 positions); top-2 of 8 experts
    # of 32 with biases; a SwiGLU limit of 0.1 so the clamps bite on these small activations
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_local_experts": 8, "intermediate_size": 32, "head_dim": 16, "sliding_window": WINDOW,
        "swiglu_limit": 0.1, "rope_parameters": {
            "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    }),
}  # fmt: skip
GPT_OSS = "gpt_oss"


def moe_config(arch: str, **overrides: object) -> transformers.PretrainedConfig:
    cls_name, _, kw = CONFIGS[arch]
    return getattr(transformers, cls_name)(**{**BASE, **kw, **overrides})


def make_moe_model(arch: str, path: Path, **overrides: object) -> PreTrainedModel:
    """A seeded random tiny model of ``arch`` saved to ``path``, float32, eval mode; norm
    weights random too (ones would hide a missing or misplaced norm) and router weights
    scaled up so routing is decided by clear margins (transformers initialises them to 0);
    gpt-oss's sinks, router bias and expert biases random and large enough to matter."""
    torch.manual_seed(0)
    cfg = moe_config(arch, **overrides)
    model = getattr(transformers, CONFIGS[arch][1])(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif arch == GPT_OSS and name.endswith(("router.weight", "router.bias", "sinks")):
                param.copy_(torch.randn_like(param) * 0.5)  # sinks of ~1 weigh like a key
            elif arch == GPT_OSS and name.endswith(("_bias", "proj.bias")):  # zeros at init
                param.copy_(torch.randn_like(param) * 0.02)  # as small as the hidden states
    model.eval()
    model.save_pretrained(path)
    return model
