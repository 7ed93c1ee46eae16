"""Shared by the attention tests: random paged batches and the backends under test."""

from __future__ import annotations

import shutil

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.paged import AttentionMetadata, write_kv
from kvserve.attention.torch_sdpa import TorchSDPABackend

# With a compiler the kernels must build: a broken build fails (see conftest) instead of
# skipping.
HAS_COMPILER = shutil.which("c++") is not None

CPU = torch.device("cpu")


def backend(use_kernel: bool) -> AttentionBackend:
    """A fresh CPU_KERNEL (``use_kernel``) or TORCH_SDPA backend on the CPU."""
    return CpuKernelBackend(CPU) if use_kernel else TorchSDPABackend(CPU)


def cpu_backends() -> list[type[AttentionBackend]]:
    """The backends that run on this machine's CPU (CPU_KERNEL needs a compiler)."""
    return [TorchSDPABackend, *([CpuKernelBackend] if HAS_COMPILER else [])]


def build_batch(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_blocks: int,
    h: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype)
    # Each request gets a random, non-contiguous set of blocks.
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl = [], [], [0]
    for sl, ql in zip(seq_lens, query_lens, strict=True):
        nb = -(-sl // block_size)
        blocks, perm = perm[:nb], perm[nb:]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(sl - ql, sl)]
        qsl.append(qsl[-1] + ql)
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=block_size,
    )
    t = qsl[-1]
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k_new = torch.randn(t, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(t, hkv, d, generator=g).to(dtype)
    write_kv(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    return q, k_cache, v_cache, md
