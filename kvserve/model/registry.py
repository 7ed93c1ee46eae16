"""Which class runs a checkpoint: kvserve's native implementation or the transformers backend.

``NATIVE_ARCHITECTURES`` maps a config's ``architectures[0]`` to kvserve's own class (fused
projections, C++ fused ops, prepacked weights). ``resolve_model_class`` applies
``ModelImpl`` (vLLM's ``--model-impl``): ``auto`` takes the native class when there is one
and the transformers backend otherwise, ``kvserve`` refuses an architecture without a native
class, ``transformers`` always takes the backend.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PretrainedConfig

from kvserve.config import ModelImpl
from kvserve.model.architectures import architecture_name
from kvserve.model.gemma import GemmaForCausalLM
from kvserve.model.gpt_oss import GptOssForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import MoEForCausalLM

NATIVE_ARCHITECTURES: dict[str, type[nn.Module]] = {
    arch: cls
    for cls in (LlamaForCausalLM, GemmaForCausalLM, MoEForCausalLM, GptOssForCausalLM)
    for arch in cls.architectures
}

# Mixture-of-experts variants neither the native classes nor the transformers backend run,
# by config ``model_type``, with the reason (checked first, whatever ``model_impl`` says).
_DEEPSEEK = (
    "multi-head latent attention (per-head keys of qk_nope_head_dim + qk_rope_head_dim and "
    "values of v_head_dim, decompressed from a kv_lora_rank latent) does not fit kvserve's "
    "paged KV cache, which holds keys and values of one head size, and its group-limited "
    "routing (n_group / topk_group, e_score_correction_bias) is not implemented by kvserve's "
    "MoE router"
)
UNSUPPORTED_MOE: dict[str, str] = {
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK + ", nor is its sparse attention indexer",
}


def check_moe_variant(hf_config: PretrainedConfig) -> None:
    """A ``ValueError`` naming the model type and the reason for an unsupported MoE variant."""
    model_type = getattr(hf_config, "model_type", "")
    reason = UNSUPPORTED_MOE.get(model_type)
    if reason is not None:
        arch = architecture_name(hf_config)
        raise ValueError(f"{arch} (model_type {model_type!r}) is not supported: {reason}")


def num_routed_experts(hf_config: PretrainedConfig) -> int:
    """How many routed experts a layer of ``hf_config`` has (0: a dense model), under the
    names transformers' MoE configs use."""
    for field in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(hf_config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def resolve_model_class(
    hf_config: PretrainedConfig, model_impl: ModelImpl | str
) -> type[nn.Module]:
    """The class to build for ``hf_config`` under ``model_impl``; a ``ValueError`` naming
    the architecture when it cannot run that way."""
    impl = ModelImpl(model_impl)
    check_moe_variant(hf_config)
    arch = architecture_name(hf_config)
    native = NATIVE_ARCHITECTURES.get(arch)
    if impl is ModelImpl.KVSERVE and native is None:
        raise ValueError(
            f"model_impl='kvserve': {arch} has no native kvserve implementation (native: "
            f"{', '.join(sorted(NATIVE_ARCHITECTURES))}); use model_impl='auto' or "
            "'transformers' to run it through the transformers backend"
        )
    if native is not None and impl is not ModelImpl.TRANSFORMERS:
        return native
    # imported here: transformers' modeling code costs ~3 s of CPU per process (architectures.py)
    from kvserve.model.transformers_backend import TransformersForCausalLM, check_supported

    check_supported(hf_config)
    return TransformersForCausalLM


def on_transformers_backend(cls: type[Any]) -> bool:
    """Whether ``resolve_model_class`` chose the transformers backend (without importing it)."""
    return bool(getattr(cls, "transformers_backend", False))
