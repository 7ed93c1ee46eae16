"""The runner's KV tensors and the attention inputs of a flat batch (shared by the target's
runner and the draft model's proposer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.attention.paged import AttentionMetadata
from kvserve.model.base import CausalLM
from kvserve.sample.host_io import to_device


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def allocate_kv_caches(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (K, V) pair per layer, each ``[num_blocks, Hkv, block_size, D]``
    (see kvserve/attention/paged.py)."""
    shape = (num_blocks, model.num_kv_heads, block_size, model.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device),
         torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model.num_layers)
    ]  # fmt: skip


def build_metadata(
    rows: Sequence[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    spec_rows: frozenset[int] = frozenset(),
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata and positions ``[T]`` for rows of (block table, first position,
    number of tokens): each row computes positions [start, start + n) of its request."""
    bs = block_size
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    for blocks, start, n in rows:
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
    width = max(len(blocks) for blocks, _, _ in rows)
    table = [blocks + [0] * (width - len(blocks)) for blocks, _, _ in rows]
    md = AttentionMetadata(
        slot_mapping=to_device(slots, torch.long, device),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=to_device(table, torch.long, device),
        block_size=bs,
        spec_rows=spec_rows,
    )
    # pinned, non-blocking on CUDA: a plain torch.tensor(..., device="cuda") waits for the
    # stream (the H200 host profile counted 3 such syncs per step here)
    return md, to_device(positions, torch.long, device)
