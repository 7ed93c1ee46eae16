"""Python side of the Triton paged-attention kernels (``attention_kernels``).

``triton_paged_attention`` takes exactly ``reference_paged_attention``'s arguments
(``kvserve/attention/paged.py``) and gives its results: the one-token rows and the
speculative verification rows (``md.spec_rows``: one decode entry per query, query ``j`` of a
row with ``Lq`` queries and context ``L`` being a decode entry of length ``L - Lq + 1 + j``) go
through one decode launch (plus the split-K reduce when a context spans several partitions),
every other multi-token row through one prefill launch. The step's lists become one int32
device tensor per call (one host-to-device copy, pinned and non-blocking on CUDA).

A backend plans a step once (``plan_attention``: the rows split between the kernels, the
lists on the device) and runs every layer on it (``run_attention``); the lower-level
``paged_decode_attention`` / ``paged_prefill_attention`` take the device tensors themselves.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from triton.runtime.interpreter import InterpretedFunction

from kvserve.ops.attention_options import check_attention_options
from kvserve.ops.triton.attention_kernels import decode_kernel, prefill_kernel, reduce_kernel

if TYPE_CHECKING:
    from kvserve.attention.paged import AttentionMetadata

__all__ = [
    "DEFAULT_TUNING",
    "AttentionPlan",
    "KernelTuning",
    "decode_partition_size",
    "interpreted",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_attention",
    "prefill_block_q",
    "prefill_tiles",
    "run_attention",
    "static_decode_plan",
    "tile_keys",
    "triton_paged_attention",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelTuning:
    """Tile sizes (powers of two, at least 16, as ``tl.dot`` needs).

    ``partition_size``: the most decode context tokens per split-K program (vLLM's
    paged-attention v2 uses 512). ``min_programs``: a decode launch with fewer (entry, KV
    head) programs than this cuts contexts into smaller partitions (down to one tile) until it
    has this many, so that a batch-1 step still fills the GPU; None: twice the GPU's SM count
    on CUDA, no minimum elsewhere. ``prefill_block_m``: query rows per prefill program (query
    tokens times the GQA group).

    ``decode_block_n``/``prefill_block_n`` are the most keys per tile; a tile holds at most
    ``tile_bytes`` of one of K or V (``tile_keys``), and programs run ``num_warps`` warps. In
    the sm_90 cubins (``benchmarks/gpu/compile_kernels.py``, Triton 3.7.1, no GPU to time
    them on) 64 keys of head_dim 128 at 4 warps used all 255 registers and spilled 440-1240 B
    of stack; at most 8 KB per tile and 8 warps, no variant spills (bf16 head_dim 64:
    decode 184 registers, prefill 162; head_dim 128: 160 and 189; fp32 64: 108 and 185).
    """

    partition_size: int = 512
    decode_block_n: int = 64
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    min_programs: int | None = None
    tile_bytes: int = 8192
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("partition_size", "decode_block_n", "prefill_block_m", "prefill_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.partition_size < self.decode_block_n:
            raise ValueError("partition_size must be at least decode_block_n")
        if self.tile_bytes < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError("tile_bytes must be positive and num_warps a power of two <= 16")
        if self.min_programs is not None and self.min_programs < 0:
            raise ValueError(f"min_programs must be >= 0 or None, got {self.min_programs}")


DEFAULT_TUNING = KernelTuning()


def tile_keys(max_keys: int, head_dim: int, dtype: torch.dtype, tuning: KernelTuning) -> int:
    """Keys per tile: ``max_keys``, halved while one tile of K is over ``tuning.tile_bytes``
    (never below 16, the smallest dot tile)."""
    row = _pow2(head_dim, 16) * torch.empty(0, dtype=dtype).element_size()
    keys = max_keys
    while keys > 16 and keys * row > tuning.tile_bytes:
        keys //= 2
    return keys


def decode_partition_size(
    entries: int, kv_heads: int, span: int, min_programs: int, tuning: KernelTuning = DEFAULT_TUNING
) -> int:
    """Context tokens per decode program: ``tuning.partition_size``, or less (a power of two,
    at least one tile) when ``entries * kv_heads`` programs per partition are fewer than
    ``min_programs`` and ``span`` (the longest context read) can be cut further."""
    per_part = max(1, entries * kv_heads)
    want = -(-min_programs // per_part)  # partitions per (entry, head) wanted
    if want <= 1:
        return tuning.partition_size
    size = _pow2(-(-span // want), tuning.decode_block_n)
    return min(size, tuning.partition_size)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _min_programs(device: torch.device, tuning: KernelTuning) -> int:
    if tuning.min_programs is not None:
        return tuning.min_programs
    if device.type != "cuda":
        return 0
    return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set
    before this module was imported): then they take CPU tensors."""
    return isinstance(decode_kernel, InterpretedFunction)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_tensors(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int]:
    """ValueError unless the shapes, dtypes and devices fit; returns (GQA group, head_dim)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"want q [T, H, D] and caches [NB, Hkv, BS, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    h, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    if k_cache.shape[3] != d or h % hkv:
        raise ValueError(
            f"{h} query heads of size {d} do not fit {hkv} KV heads of size {k_cache.shape[3]}"
        )
    if q.dtype not in _DTYPES or {k_cache.dtype, v_cache.dtype, out.dtype} != {q.dtype}:
        raise ValueError(f"q, caches and out must share one of {_DTYPES}")
    if out.shape != q.shape or len({t.device for t in (q, k_cache, v_cache, out)}) != 1:
        raise ValueError("out must match q's shape, and every tensor be on one device")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out)):
        raise ValueError("head_dim must be the contiguous dimension of q, out and the caches")
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError("Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    return h // hkv, d


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    entry_rows: torch.Tensor,
    entry_tokens: torch.Tensor,
    entry_lens: torch.Tensor,
    scale: float,
    *,
    max_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
    max_parts: int | None = None,
) -> None:
    """Decode entries: ``out[tok]`` = attention of ``q[tok]`` over its row's first ``len`` keys.

    q/out ``[T, H, D]``; caches ``[NB, Hkv, BS, D]``; block_tables ``[B, max_blocks]``;
    entry_rows/entry_tokens/entry_lens ``[E]`` int32 (row, query token, context length).
    ``max_len`` (a host int, at least every entry's length) sizes the split-K partitions
    without reading the device. ``max_parts``: at most this many partitions (longer ones
    instead), for a static plan whose ``max_len`` is the model's limit (None: no cap).
    ``sinks``: ``[H]`` attention-sink logits (gpt-oss; None: none).
    """
    check_attention_options(sliding_window, soft_cap, sinks, q.shape[1])
    group, d = _check_tensors(out, q, k_cache, v_cache)
    e, hkv, bs = entry_rows.shape[0], k_cache.shape[1], k_cache.shape[2]
    if e == 0:
        return
    span = max_len if sliding_window is None else min(max_len, sliding_window)
    size = decode_partition_size(e, hkv, span, _min_programs(q.device, tuning), tuning)
    if max_parts is not None:
        size = _pow2(-(-span // max_parts), size)
    parts = max(1, -(-span // size))
    d_pad = _pow2(d, 16)
    f32 = dict(dtype=torch.float32, device=q.device)
    split = parts > 1
    part_acc = torch.empty(e, q.shape[1], parts, d_pad, **f32) if split else q.new_empty(1, **f32)
    part_ml = torch.empty(2, e, q.shape[1], parts, **f32) if split else part_acc
    decode_kernel[(e, hkv, parts)](
        out, q, k_cache, v_cache, block_tables, entry_rows, entry_tokens, entry_lens,
        part_acc, part_ml, _sinks_arg(sinks, q), parts, float(scale), float(soft_cap or 0.0),
        sliding_window or 0, size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), BLOCK_SIZE=bs,
        GROUP=group, BLOCK_G=_pow2(group, 16), HEAD_DIM=d, HEAD_DIM_PAD=d_pad,
        BLOCK_N=tile_keys(tuning.decode_block_n, d, q.dtype, tuning), SPLIT=split,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=tuning.num_warps,
    )  # fmt: skip
    if split:
        reduce_kernel[(e, q.shape[1])](
            out, part_acc, part_ml, entry_tokens, parts, out.stride(0), out.stride(1),
            PARTS_PAD=_pow2(parts), HEAD_DIM=d, HEAD_DIM_PAD=d_pad,
        )  # fmt: skip


def prefill_block_q(group: int, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Query tokens per prefill program: ``prefill_block_m`` rows over the padded group."""
    return max(1, tuning.prefill_block_m // _pow2(group))


def prefill_tiles(
    query_start_loc: list[int], rows: list[int], block_q: int
) -> tuple[list[int], list[int]]:
    """(row, first query) of each prefill program: ``rows`` cut into ``block_q`` queries."""
    tile_rows: list[int] = []
    tile_q0: list[int] = []
    for i in rows:
        for j in range(0, query_start_loc[i + 1] - query_start_loc[i], block_q):
            tile_rows.append(i)
            tile_q0.append(j)
    return tile_rows, tile_q0


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_rows: torch.Tensor,
    tile_q0: torch.Tensor,
    scale: float,
    *,
    block_q: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> None:
    """Multi-token rows in one launch, causal with the cached context as offset.

    query_start_loc ``[B + 1]`` / seq_lens ``[B]`` int32 as ``AttentionMetadata``'s lists;
    tile_rows/tile_q0 ``[n]`` int32 from ``prefill_tiles(..., block_q)`` with ``block_q`` from
    ``prefill_block_q`` (the tiles must be cut with the launch's ``block_q``). ``sinks``:
    ``[H]`` attention-sink logits (gpt-oss; None: none).
    """
    check_attention_options(sliding_window, soft_cap, sinks, q.shape[1])
    group, d = _check_tensors(out, q, k_cache, v_cache)
    n, hkv = tile_rows.shape[0], k_cache.shape[1]
    block_g = _pow2(group)
    if block_q * block_g < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two with block_q * {block_g} >= 16")
    if n == 0:
        return
    prefill_kernel[(n, hkv)](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, tile_rows, tile_q0,
        _sinks_arg(sinks, q), float(scale), float(soft_cap or 0.0), sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), BLOCK_SIZE=k_cache.shape[2],
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=d, HEAD_DIM_PAD=_pow2(d, 16),
        BLOCK_N=tile_keys(tuning.prefill_block_n, d, q.dtype, tuning),
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=tuning.num_warps,
    )  # fmt: skip


def _sinks_arg(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' sink pointer: the ``[H]`` logits as contiguous float32 on q's device, or
    (no sinks) q itself, which the kernel never reads."""
    if sinks is None:
        return q
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as one int32 tensor on ``device``: on CUDA from pinned memory without
    blocking the host (``torch.tensor(list, device=cuda)`` is a blocking pageable copy)."""
    host = torch.tensor(values, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class AttentionPlan:
    """One step's rows as the kernels take them: built once per step from the metadata's
    lists (one host-to-device copy) and shared by every layer."""

    block_tables: torch.Tensor  # [B, max_blocks] the metadata's
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    entry_rows: torch.Tensor  # [E] int32: decode entries (one-token rows, verification queries)
    entry_tokens: torch.Tensor  # [E] int32
    entry_lens: torch.Tensor  # [E] int32
    max_entry_len: int  # the longest entry context (0: no entries)
    tile_rows: torch.Tensor  # [n] int32: prefill query tiles
    tile_q0: torch.Tensor  # [n] int32
    block_q: int  # query tokens per prefill tile
    # a static plan's cap on split-K partitions (``static_decode_plan``); None: no cap
    max_parts: int | None = None


def plan_attention(
    md: AttentionMetadata,
    group: int,
    device: torch.device,
    rows: list[int] | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> AttentionPlan:
    """Split ``md``'s rows (or only ``rows``) between the kernels for GQA group ``group``
    (query heads per KV head): one-token rows and ``md.spec_rows`` become decode entries
    (query ``t`` of a row whose last query is ``qe - 1`` sees ``L - (qe - 1 - t)`` keys), the
    other multi-token rows prefill tiles."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # its one host-to-device copy would be captured reading a pinned buffer that is
        # freed after the step: a replay would attend with stale lengths
        raise RuntimeError("plan_attention reads host lists: a captured step needs a static "
                           "plan (static_decode_plan)")  # fmt: skip
    qsl, lens = md.query_start_loc, md.seq_lens
    entries: tuple[list[int], list[int], list[int]] = ([], [], [])
    prefill: list[int] = []
    for i in range(md.num_rows) if rows is None else rows:
        lq = qsl[i + 1] - qsl[i]
        if lens[i] < lq:
            raise ValueError(f"row {i}: {lq} queries but a context of only {lens[i]} tokens")
        if lq > 1 and i not in md.spec_rows:
            prefill.append(i)
            continue
        for t in range(qsl[i], qsl[i + 1]):
            entries[0].append(i)
            entries[1].append(t)
            entries[2].append(lens[i] - (qsl[i + 1] - 1 - t))
    block_q = prefill_block_q(group, tuning)
    tiles = prefill_tiles(qsl, prefill, block_q)
    e, b, n = len(entries[0]), len(lens), len(tiles[0])
    meta = _device_ints([*qsl, *lens, *entries[0], *entries[1], *entries[2], *tiles[0], *tiles[1]],
                        device)  # fmt: skip
    cut = list(itertools.accumulate([b + 1, b, e, e, e, n, n]))
    parts = [meta[lo:hi] for lo, hi in zip([0, *cut[:-1]], cut, strict=True)]
    return AttentionPlan(md.block_tables, *parts[:5], max(entries[2], default=0), *parts[5:],
                         block_q)  # fmt: skip


# A static plan's most split-K partitions: its ``max_len`` is the model's context limit, and
# every partition of every entry is a program that writes its (empty) share, so a long limit
# gets longer partitions instead of thousands of programs (vLLM's unified Triton kernel cuts
# a sequence into at most 16 segments); below 32 x 512 = 16,384 tokens the cap never changes
# the size. A partition past an entry's context adds exactly 0 in the reduce, so the results
# are the eager path's bit for bit wherever both cut at the same size (the eager size comes
# from the step's longest context, this one from ``max_len``: they differ only where
# ``min_programs`` cuts a small batch's partitions below 512 and the limit is long).
STATIC_MAX_PARTS = 32


def static_decode_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    max_parts: int = STATIC_MAX_PARTS,
) -> AttentionPlan:
    """A plan for a decode-only step read from device tensors alone, so that a CUDA graph can
    replay it: row ``i`` has one query (token ``i``) and context ``seq_lens[i]`` (int32 ``[B]``,
    written before each replay), ``block_tables`` ``[B, max_blocks]``; split-K is sized from
    ``max_len`` (the model's context limit, not the step's), so the launch grid depends on
    ``B`` only. Built once per captured batch size; nothing is copied from the host."""
    b, device = seq_lens.shape[0], seq_lens.device
    rows = torch.arange(b, dtype=torch.int32, device=device)  # [B] entry i = row i = token i
    qsl = torch.arange(b + 1, dtype=torch.int32, device=device)  # [B + 1]
    return AttentionPlan(block_tables, qsl, seq_lens, rows, rows, seq_lens, max_len,
                         rows[:0], rows[:0], 1, max_parts)  # fmt: skip


def run_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> None:
    """One layer: the decode launch (and its reduce) and the prefill launch of ``plan``."""
    opts = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, tuning=tuning)
    if plan.entry_rows.numel():
        paged_decode_attention(
            out, q, k_cache, v_cache, plan.block_tables, plan.entry_rows, plan.entry_tokens,
            plan.entry_lens, scale, max_len=plan.max_entry_len, max_parts=plan.max_parts,
            **opts,
        )  # fmt: skip
    if plan.tile_rows.numel():
        paged_prefill_attention(
            out, q, k_cache, v_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens,
            plan.tile_rows, plan.tile_q0, scale, block_q=plan.block_q, **opts,
        )  # fmt: skip


def triton_paged_attention(
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
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """``reference_paged_attention``'s contract on the Triton kernels: attention for each row
    (or only ``rows``; other tokens of ``out`` are left as they are). Returns ``[T, H, D]``.
    Plans the step on every call; a backend plans once per step (``plan_attention``) and
    calls ``run_attention`` per layer."""
    check_attention_options(sliding_window, soft_cap, sinks, q.shape[1])
    if out is None:
        out = torch.empty_like(q)
    group = q.shape[1] // max(1, k_cache.shape[1])
    plan = plan_attention(md, group, q.device, rows, tuning)
    run_attention(plan, q, k_cache, v_cache, scale, out, sliding_window=sliding_window,
                  soft_cap=soft_cap, sinks=sinks, tuning=tuning)  # fmt: skip
    return out
