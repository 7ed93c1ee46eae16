"""Paged attention over a block-table KV cache: the metadata and the shared paths.

The KV cache of one layer is two tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``
(vLLM's layout): one head's vectors of a block are one contiguous run, which decode attention
reads at full memory bandwidth (with heads innermost, one head's vectors are short runs a
whole token apart and the kernel read 1.6x slower). A request's context lives in the blocks
its block table lists, in order; token ``p`` of the request sits in block
``block_table[p // block_size]`` at offset ``p % block_size``.

- ``reference_paged_attention``: one request at a time, the plain definition. It is the
  yardstick every backend is tested against, and the path for rows the fast paths leave.
- ``paged_attention``: every row of a step, with the decode rows (one query token) handed to
  a backend's decode function (``sdpa_decode`` here: one batched SDPA over a padded gather of
  their contexts, any device; ``attention/cpu_kernel.py``: the C++ kernel). Multi-token rows
  are batched too (``prefill.py``): fresh prompts of one length share one SDPA call
  (bit-identical to the loop), and the other prefill rows (chunks after cached context,
  prefix-cache hits, lone prompts) go in size buckets through one padded SDPA call each over
  their gathered contexts. Speculative verification rows (the last token plus k proposals,
  ``spec_rows``) join the decode batch as one entry per query: query j of a row whose context
  ends at L sees exactly the first L - Lq + 1 + j keys, which is a decode row of that length
  over the same block table, so the decode path serves them unchanged and each query gets the
  very numbers a one-token step at that position would.

Backends (``backend.py``) call these; models call the backend they are handed, never these.

Both take ``sliding_window`` (query at position ``i`` sees keys ``i - window < j <= i``, Hugging
Face's ``sliding_window_overlay``), ``soft_cap`` (scores ``cap * tanh(s / cap)`` after the
scale, before mask and softmax, as Gemma 2's ``attn_logit_softcapping``) and ``sinks``
(gpt-oss's attention sinks: a float logit per query head, ``[H]``, that joins each query's
softmax denominator and contributes no value), per call since they vary by layer. The cache
keeps every block; only the reads are windowed: the kernel starts at the window's first token,
the SDPA paths add the window to their masks (built once per step and window), and a soft-cap
or sinks take an explicit float32 path instead of SDPA (which has neither).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.attention.prefill import (
    ContextGroup,
    PrefillGroup,
    attend,
    batched_context,
    batched_prefill,
    cached_window_mask,
    group_context_rows,
    group_fresh_prompts,
)
from kvserve.ops.attention_options import check_attention_options

__all__ = [
    "AttentionMetadata",
    "ContextGroup",
    "DecodeBatch",
    "DecodeFn",
    "GatherWorkspace",
    "PrefillGroup",
    "paged_attention",
    "reference_paged_attention",
    "sdpa_decode",
    "write_kv",
]


class GatherWorkspace:
    """Reusable buffers for gathered decode K/V, owned by the runner and kept across steps.

    A fresh tensor of tens of MB per layer costs more in page faults than the copy into it
    (measured: index_select into a new 42 MB tensor 13.8 ms, into a reused one 1.6 ms).
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    def get(self, i: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Buffer ``i`` viewed as ``shape``; grown (never shrunk) when too small."""
        numel = math.prod(shape)
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=like.dtype, device=like.device))
        buf = self._bufs[i]
        if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._bufs[i] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


@dataclass
class DecodeBatch:
    """The one-token rows of a step, prepared once and shared by every layer."""

    token_idx: torch.Tensor | None  # [Bd] their token positions in the flat batch; None = all
    block_tables: torch.Tensor  # [Bd, nb] blocks covering the longest decode context
    seq_lens: torch.Tensor  # [Bd] int64 context length of each decode row
    block_size: int  # tokens per block
    workspace: GatherWorkspace | None = None  # reusable gather buffers (None: allocate)
    _mask: torch.Tensor | None = None  # key_mask(), built on first use
    _pads: tuple[torch.Tensor, torch.Tensor] | None = None  # pad_slots(), built on first use
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # mask by sliding window

    def key_mask(self) -> torch.Tensor:
        """``[Bd, 1, 1, nb * block_size]`` bool, key in the row's context (the SDPA path's;
        built by the first layer that asks, kept for the step: a kernel never builds it)."""
        if self._mask is None:
            bd, nb = self.block_tables.shape
            pos = torch.arange(nb * self.block_size, device=self.seq_lens.device)
            self._mask = (pos[None, :] < self.seq_lens[:, None]).view(bd, 1, 1, -1)
        return self._mask

    def pad_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gathered block, offset) ``[p]`` each of the gathered key slots past each row's
        context: its last block's tail and its padding blocks (block 0 of the cache)."""
        if self._pads is None:
            bd, nb = self.block_tables.shape
            bs = self.block_size
            pad = ~self.key_mask().view(bd * nb, bs)  # [Bd * nb, bs], True past the context
            self._pads = torch.nonzero(pad, as_tuple=True)  # type: ignore[assignment]
        assert self._pads is not None
        return self._pads


@dataclass
class AttentionMetadata:
    """Everything attention needs about the flat batch of one step (built by the runner)."""

    slot_mapping: torch.Tensor  # [T] int64: flat slot (block * block_size + offset) per new token
    query_start_loc: list[int]  # [B + 1]: row i's queries are tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [B]: context length of row i after this step (computed + scheduled)
    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0 (never read unmasked)
    block_size: int  # tokens per block
    decode: DecodeBatch | None = None  # the one-token rows, None when there are none
    prefill_rows: list[int] | None = None  # multi-token rows left to the loop (None: unsplit)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)  # batched fresh prompts
    context_groups: list[ContextGroup] = field(default_factory=list)  # batched other prefills
    # multi-token rows to attend as decode rows, one entry per query (speculative verification)
    spec_rows: frozenset[int] = frozenset()
    # A backend's plan read from device tensors alone (``AttentionBackend.
    # static_decode_metadata``, for a step replayed as a CUDA graph): then every row is one
    # decode token, ``seq_lens`` is empty (the lengths live on the device only) and the
    # backend must attend from the plan, never from the lists.
    static_plan: object | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    def split_rows(
        self, workspace: GatherWorkspace | None = None, *, batch_context: bool = True
    ) -> None:
        """Derive the decode batch and prefill batches once per step (shared by every layer):
        the common part of every backend's metadata builder.

        ``batch_context=False`` leaves the prefill rows outside fresh-prompt groups to the
        per-row loop (the old path, kept for comparison).
        """
        device = self.block_tables.device
        qsl = self.query_start_loc
        dec = [i for i in range(self.num_rows) if qsl[i + 1] - qsl[i] == 1 or i in self.spec_rows]
        multi = [i for i in range(self.num_rows) if qsl[i + 1] - qsl[i] > 1]
        multi = [i for i in multi if i not in self.spec_rows]
        self.prefill_groups, self.prefill_rows = group_fresh_prompts(self, multi)
        self.context_groups = []
        if batch_context and self.prefill_rows:
            self.context_groups = group_context_rows(self, self.prefill_rows, workspace)
            self.prefill_rows = []
        if not dec:
            self.decode = None
            return
        # One entry per query: (its row, its token in the flat batch, its context length).
        entries = [
            (i, t, self.seq_lens[i] - (qsl[i + 1] - 1 - t))
            for i in dec
            for t in range(qsl[i], qsl[i + 1])
        ]
        lens = torch.tensor([e[2] for e in entries], dtype=torch.long, device=device)  # [Bd]
        nb = -(-max(e[2] for e in entries) // self.block_size)
        all_decode = len(dec) == len(entries) == self.num_rows  # every row, one query each
        rows = torch.tensor([e[0] for e in entries], dtype=torch.long, device=device)
        tables = self.block_tables[:, :nb] if all_decode else self.block_tables[rows, :nb]
        self.decode = DecodeBatch(
            token_idx=None
            if all_decode
            else torch.tensor([e[1] for e in entries], dtype=torch.long, device=device),
            block_tables=tables,
            seq_lens=lens,
            block_size=self.block_size,
            workspace=workspace,
        )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V (``[T, Hkv, D]``) into their slots of the paged cache."""
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [T] each
    k_cache[blocks, :, offsets] = k  # advanced indices around a slice: [T, Hkv, D]
    v_cache[blocks, :, offsets] = v


def _context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request, ``[L, Hkv, D]``, read through its blocks."""
    _, hkv, bs, d = cache.shape
    blocks = cache[block_table[: -(-seq_len // bs)]]  # [nb, Hkv, bs, D]
    return blocks.transpose(1, 2).reshape(-1, hkv, d)[:seq_len]


def _attend_one(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``Lq`` positions) over ``L`` context tokens."""
    lq, lk = q.shape[0], k_ctx.shape[0]
    # Query i sits at absolute position lk - lq + i and may see keys 0..that position, and
    # with a window only those past that position - window.
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    if sliding_window is not None and sliding_window < lk:
        mask = mask.triu(diagonal=lk - lq - sliding_window + 1)
    out = attend(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Lq, D]
        k_ctx.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
        v_ctx.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        soft_cap,
        sinks,
    )  # [1, H, Lq, D]
    return out.squeeze(0).transpose(0, 1)  # [Lq, H, D]


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    rows: list[int] | None = None,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for each request (or only ``rows``), reading K/V through its block table.

    q: ``[T, H, D]`` queries of the flat batch (their K/V must already be written).
    ``sliding_window``/``soft_cap``/``sinks``: see the module docstring (None: unset). With a
    soft-cap or sinks the scores are computed in float32 whatever q's dtype. Returns
    ``[T, H, D]``.
    """
    check_attention_options(sliding_window, soft_cap, sinks, q.shape[1])
    if out is None:
        out = torch.empty_like(q)
    for i in range(md.num_rows) if rows is None else rows:
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        k_ctx = _context(k_cache, md.block_tables[i], md.seq_lens[i])  # [L, Hkv, D]
        v_ctx = _context(v_cache, md.block_tables[i], md.seq_lens[i])
        out[start:end] = _attend_one(
            q[start:end], k_ctx, v_ctx, scale, sliding_window, soft_cap, sinks
        )
    return out


# A backend's decode path: (q [T, H, D], k_cache, v_cache, the decode batch, scale, out
# [T, H, D] to fill at the batch's rows, sliding_window, soft_cap, sinks [H] or None).
DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, DecodeBatch, float, torch.Tensor, int | None,
     float | None, torch.Tensor | None],
    None,
]  # fmt: skip


def sdpa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dec: DecodeBatch,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> None:
    """All one-token rows at once: one SDPA over their gathered contexts (any device)."""
    # Gather whole blocks: [Bd * nb, Hkv, bs, D] -> [Bd, Hkv, nb * bs, D]. index_select on the
    # flat table copies contiguous blocks and is ~3x faster than advanced indexing.
    bd, nb = dec.block_tables.shape
    flat = dec.block_tables.reshape(-1)
    _, hkv, bs, d = k_cache.shape
    ws = dec.workspace
    if ws is None:
        k_blocks = k_cache.index_select(0, flat)
        v_blocks = v_cache.index_select(0, flat)
    else:
        k_blocks = torch.index_select(k_cache, 0, flat, out=ws.get(0, (bd * nb, hkv, bs, d), q))
        v_blocks = torch.index_select(v_cache, 0, flat, out=ws.get(1, (bd * nb, hkv, bs, d), q))
    blocks, offsets = dec.pad_slots()
    if blocks.numel():
        # Masked keys still enter SDPA's sums (score + -inf, then 0 * V): a NaN left in a
        # reused block (a request whose K/V overflowed) would turn the row's output into NaN.
        # Zeros are harmless; the kernel and the reference never read these slots.
        k_blocks[blocks, :, offsets] = 0
        v_blocks[blocks, :, offsets] = 0
    # [Bd, nb, Hkv, bs, D] -> [Bd, Hkv, nb, bs, D] -> [Bd, Hkv, nb * bs, D] (SDPA takes the
    # strided view; a block's tokens stay contiguous).
    k = k_blocks.view(bd, nb, hkv, bs, d).transpose(1, 2).reshape(bd, hkv, nb * bs, d)
    v = v_blocks.view(bd, nb, hkv, bs, d).transpose(1, 2).reshape(bd, hkv, nb * bs, d)
    qd = (q if dec.token_idx is None else q[dec.token_idx]).unsqueeze(2)  # [Bd, H, 1, D]
    mask = cached_window_mask(dec._windowed, dec.key_mask(), sliding_window)  # [Bd, 1, 1, nb * bs]
    o = attend(qd, k, v, mask, scale, soft_cap, sinks).squeeze(2)  # [Bd, H, D]
    if dec.token_idx is None:
        out.copy_(o)
    else:
        out[dec.token_idx] = o


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    decode: DecodeFn = sdpa_decode,
) -> torch.Tensor:
    """Every row of the step with the reference's results: the decode rows by ``decode``,
    the prefill rows batched (``md.split_rows`` ran, or runs here without a workspace).

    ``sliding_window``/``soft_cap``/``sinks`` as ``reference_paged_attention`` (None: unset,
    and then every path runs exactly as without them).
    """
    check_attention_options(sliding_window, soft_cap, sinks, q.shape[1])
    if md.prefill_rows is None:
        md.split_rows()
    out = torch.empty_like(q)
    opts = (sliding_window, soft_cap, sinks)
    if md.decode is not None:
        decode(q, k_cache, v_cache, md.decode, scale, out, *opts)
    for group in md.prefill_groups:
        batched_prefill(q, k_cache, v_cache, group, scale, out, *opts)
    for ctx in md.context_groups:  # after decode: they reuse its workspace buffers
        batched_context(q, k_cache, v_cache, ctx, scale, out, *opts)
    if md.prefill_rows:
        reference_paged_attention(
            q,
            k_cache,
            v_cache,
            md,
            scale,
            rows=md.prefill_rows,
            out=out,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
        )
    return out
