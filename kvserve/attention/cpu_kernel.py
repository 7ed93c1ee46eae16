"""``CPU_KERNEL``: decode rows on the C++ kernel (``csrc/paged_decode.cpp``), which reads K/V
in place through the block tables; prefill rows as ``TORCH_SDPA``.

The kernel is the default on a CPU: with gather + SDPA a decode step copies every row's
context per layer. Supports float32 and bfloat16, head sizes that are a multiple of 16 (one
AVX-512 vector, the widest it is compiled for), sliding windows, soft-caps and attention sinks
(gpt-oss). Decode-only
steps of native Llama-family models may run all their layers in one C++ call
(``model/decode_loop.py``), which calls this same kernel: only with this backend.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata, DecodeBatch, paged_attention
from kvserve.config import AttentionBackendEnum
from kvserve.ops import cpu_kernels


def kernel_decode(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    dec: DecodeBatch,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """All one-token rows in one kernel call, written into their rows of ``out``."""
    rows = dec.token_idx if dec.token_idx is not None else dec.seq_lens[:0]  # empty: row i = i
    cpu_kernels.paged_decode_attention(
        out, q, k_cache, v_cache, dec.block_tables, dec.seq_lens, rows, scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
    )  # fmt: skip


class CpuKernelBackend(AttentionBackend):
    name = AttentionBackendEnum.CPU_KERNEL
    device_types = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.bfloat16})

    @classmethod
    def check_head_size(cls, head_size: int) -> str | None:
        if head_size % 16:
            return f"its head size must be a multiple of 16, the model's is {head_size}"
        return None

    @classmethod
    def available(cls) -> str | None:
        if not cpu_kernels.available():  # builds them on first call (after the cheap checks)
            return "the C++ CPU kernels failed to build (see the warning above)"
        return None

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
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, decode=kernel_decode,
        )  # fmt: skip
