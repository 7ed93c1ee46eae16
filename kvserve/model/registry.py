"""Which class runs a checkpoint: kvserve's native implementation or the transformers backend.

``NATIVE_ARCHITECTURES`` maps a config's ``architectures[0]`` to kvserve's own class (fused
projections, C++ fused ops, prepacked weights). ``resolve_model_class`` applies
``ModelImpl`` (vLLM's ``--model-impl``): ``auto`` takes the native class when there is one
and the transformers backend otherwise, ``kvserve`` refuses an architecture without a native
class, ``transformers`` always takes the backend.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from kvserve.config import ModelImpl
from kvserve.model.gemma import GemmaForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import MoEForCausalLM
from kvserve.model.transformers_backend import (
    TransformersForCausalLM,
    architecture_name,
    check_supported,
)

NATIVE_ARCHITECTURES: dict[str, type[nn.Module]] = {
    arch: cls
    for cls in (LlamaForCausalLM, GemmaForCausalLM, MoEForCausalLM)
    for arch in cls.architectures
}


def resolve_model_class(
    hf_config: PretrainedConfig, model_impl: ModelImpl | str
) -> type[nn.Module]:
    """The class to build for ``hf_config`` under ``model_impl``; a ``ValueError`` naming
    the architecture when it cannot run that way."""
    impl = ModelImpl(model_impl)
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
    check_supported(hf_config)
    return TransformersForCausalLM
