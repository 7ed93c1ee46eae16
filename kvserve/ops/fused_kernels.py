"""Which fused decoder-layer kernels a model on a given device and dtype runs.

The C++ CPU kernels (``cpu_kernels``) and the Triton kernels (``triton/fused_ops.py``) have the
same functions and signatures (``rms_norm``, ``add_rms_norm``, ``silu_and_mul``,
``gelu_tanh_and_mul``, ``rope_write_kv``), so a model resolves the module once, when it turns
its fused ops on, and calls through it: no per-call dispatch on the CPU's hot path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvserve.ops import cpu_kernels

_CPU_DTYPES = (torch.bfloat16, torch.float32)
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_kernels_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernel module for weights on ``device`` in ``dtype``; None: keep the op chains."""
    if device.type == "cpu":
        return cpu_kernels if dtype in _CPU_DTYPES and cpu_kernels.available() else None
    if device.type == "cuda" and dtype in _CUDA_DTYPES:
        try:
            from kvserve.ops.triton import fused_ops
        except ImportError:  # no triton package: the PyTorch op chains
            return None
        return fused_ops
    return None
