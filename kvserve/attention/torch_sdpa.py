"""``TORCH_SDPA``: gather + PyTorch SDPA, the reference backend on any device.

Decode rows: one batched SDPA over a padded gather of their contexts (``paged.sdpa_decode``);
prefill rows: the batched groups of ``prefill.py``. On CUDA this is correct but slow (about
five passes over the KV per layer, and the explicit mask rules out FlashAttention): the
``TRITON_ATTN`` backend is the fast one there.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata, paged_attention, sdpa_decode
from kvserve.config import AttentionBackendEnum


class TorchSDPABackend(AttentionBackend):
    name = AttentionBackendEnum.TORCH_SDPA
    device_types = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q, k_cache, v_cache, md, scale,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, decode=sdpa_decode,
        )  # fmt: skip
