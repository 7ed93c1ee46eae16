"""Choosing the attention backend: an explicit ``attention_backend``, or the best that fits.

``BACKENDS`` maps each name to its class by import path, so a backend whose package is
missing (Triton on a machine without it) costs nothing until it is asked for. ``AUTO`` tries
``AUTO_ORDER`` for the device type and takes the first that supports the model; an explicit
choice that does not is an error naming the reason.
"""

from __future__ import annotations

import importlib
import logging

import torch
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend
from kvserve.config import AttentionBackendEnum

logger = logging.getLogger(__name__)

# name -> "module:Class" (vLLM's registry shape); TRITON_ATTN imports Triton only when asked.
BACKENDS: dict[AttentionBackendEnum, str] = {
    AttentionBackendEnum.TORCH_SDPA: "kvserve.attention.torch_sdpa:TorchSDPABackend",
    AttentionBackendEnum.CPU_KERNEL: "kvserve.attention.cpu_kernel:CpuKernelBackend",
    AttentionBackendEnum.TRITON_ATTN: "kvserve.attention.triton:TritonAttentionBackend",
}

# AUTO's preference per device type; TORCH_SDPA last, as it runs everywhere.
AUTO_ORDER: dict[str, tuple[AttentionBackendEnum, ...]] = {
    "cpu": (AttentionBackendEnum.CPU_KERNEL, AttentionBackendEnum.TORCH_SDPA),
    "cuda": (AttentionBackendEnum.TRITON_ATTN, AttentionBackendEnum.TORCH_SDPA),
}


class BackendUnavailable(Exception):
    """A backend's module or class is missing (the message says which)."""


def backend_class(name: AttentionBackendEnum) -> type[AttentionBackend]:
    """The class registered for ``name``; BackendUnavailable when it cannot be imported."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"no backend is registered for {name.value}")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"{BACKENDS[name]} cannot be imported ({exc})") from exc
    return cls  # type: ignore[no-any-return]


def model_attention_features(config: PretrainedConfig) -> tuple[bool, bool, bool]:
    """(has sliding-window layers, soft-caps scores, has attention sinks) as the model's
    config declares them (sinks: gpt-oss, every layer)."""
    window = bool(getattr(config, "sliding_window", None))
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2/3: off unless asked
        window = False
    types = getattr(config, "layer_types", None)
    if types is not None:
        window = window and "sliding_attention" in types
    sinks = getattr(config, "model_type", None) == "gpt_oss"
    return window, bool(getattr(config, "attn_logit_softcapping", None)), sinks


def select_attention_backend(
    choice: AttentionBackendEnum,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    *,
    sliding_window: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
) -> AttentionBackend:
    """An instance of the chosen backend, or with ``AUTO`` of the first in ``AUTO_ORDER``
    that supports these properties. ValueError naming the reason when an explicit choice
    does not support them (or is not installed)."""
    features = {"sliding_window": sliding_window, "soft_cap": soft_cap, "sinks": sinks}
    if choice is not AttentionBackendEnum.AUTO:
        try:
            cls = backend_class(choice)
        except BackendUnavailable as exc:
            raise ValueError(f"attention_backend {choice.value} is not available: {exc}") from exc
        reason = cls.supports(device, dtype, head_size, **features)
        if reason is not None:
            raise ValueError(
                f"attention_backend {choice.value} cannot run this model on {device} "
                f"({_describe(dtype, head_size)}): {reason}"
            )
        return cls(device)
    skipped = []
    for name in AUTO_ORDER.get(device.type, (AttentionBackendEnum.TORCH_SDPA,)):
        try:
            cls = backend_class(name)
        except BackendUnavailable as exc:
            skipped.append(f"{name.value}: {exc}")
            continue
        reason = cls.supports(device, dtype, head_size, **features)
        if reason is None:
            if skipped:
                logger.info("attention backend %s (skipped %s)", name.value, "; ".join(skipped))
            return cls(device)
        skipped.append(f"{name.value}: {reason}")
    raise ValueError(
        f"no attention backend runs this model on {device} ({_describe(dtype, head_size)}): "
        + "; ".join(skipped)
    )


def select_for_model(
    choice: AttentionBackendEnum,
    config: PretrainedConfig,
    head_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionBackend:
    """``select_attention_backend`` for a model: its window, soft-cap and sinks from its
    config."""
    window, cap, sinks = model_attention_features(config)
    return select_attention_backend(
        choice, device, dtype, head_size, sliding_window=window, soft_cap=cap, sinks=sinks
    )


def _describe(dtype: torch.dtype, head_size: int) -> str:
    return f"{str(dtype).removeprefix('torch.')}, head size {head_size}"
