"""Triton kernels for paged attention over vLLM's KV layout (``kvserve/attention/paged.py``).

A layer's cache is ``k_cache``/``v_cache`` ``[num_blocks, num_kv_heads, block_size, head_dim]``;
token ``p`` of a row sits in block ``block_table[p // block_size]`` at offset
``p % block_size``. The kernels read K/V in place through the block table, one token per key
slot of a tile (a tile need not line up with cache blocks, so any block size works), and keep
the online softmax (running max ``m``, sum ``l``, unnormalised output ``acc``) in float32.

- ``decode_kernel``: one program per (decode entry, KV head, context partition). The
  ``GROUP = H / Hkv`` query heads that share a KV head are the rows of one ``tl.dot`` (padded
  to 16, the smallest dot tile), so a KV tile is read once per group. Long contexts split into
  partitions (split-K); ``reduce_kernel`` merges the partitions' ``(m, l, acc)``.
- ``prefill_kernel``: one program per (query tile of a row, KV head) over every multi-token
  row of the step in one launch: ``BLOCK_Q`` query tokens times the group's heads are the
  ``BLOCK_M`` rows of the dot; query ``j`` of a row with ``Lq`` queries and context ``L`` sits
  at position ``L - Lq + j`` and sees keys ``<=`` its position (causal with the cached context
  as offset), no padding tensors and no mask tensors.

Attention sinks (gpt-oss, ``HAS_SINKS``): head ``h``'s sink logit starts the online softmax
(``m = sink``, ``l = 1``, ``acc = 0``), so it joins every query's denominator and adds no
value; in a split decode only partition 0 starts from it, and the reduce merges it with the
others like any partition.

Only Triton APIs present in both 3.6 and 3.7 are used (there is no ``tl.tanh`` in either:
the soft-cap uses ``exp``). Masked-out scores are ``-inf``; a row whose keys in a tile are
all masked keeps ``m = -inf`` and the subtraction uses 0 instead, so no ``-inf - -inf`` NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)`` in float32, as ``tanh(|x|) = (1 - e^-2|x|) / (1 + e^-2|x|)``:
    ``e^-2|x|`` is in (0, 1], so nothing overflows for any score."""
    t = tl.exp(-2.0 * tl.abs(s / cap))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(s >= 0, th, -th) * cap


@triton.jit
def _attend_range(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    table_row,
    lo,
    hi,
    q_pos,
    window,
    scale,
    cap,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys ``lo <= j < hi`` into ``(acc [M, Dp], m_i [M], l_i [M])`` for ``q [M, Dp]``.

    ``k_base``/``v_base`` point at the KV head's slice of block 0; ``table_row`` at the row's
    block table. ``CAUSAL``: key ``j`` visible to row ``r`` only when ``j <= q_pos[r]``;
    ``HAS_WINDOW``: and ``j > q_pos[r] - window``. ``DOT_PRECISION``: "ieee" for float32
    inputs (the reference is exact float32; the GPU default would be TF32), else "tf32" (the
    default, which only float32 inputs read).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [N] token positions of this tile
        in_ctx = pos < hi
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = block * stride_kb + offset * stride_kt  # [N]
        kt = tl.load(
            k_base + k_off[None, :] + offs_d[:, None],
            mask=in_ctx[None, :] & d_mask[:, None],
            other=0.0,
        )  # [Dp, N]
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale  # [M, N] float32
        if HAS_CAP:
            s = _soft_cap(s, cap)
        visible = in_ctx[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_sub[:, None])  # [M, N]
        alpha = tl.exp(m_i - m_sub)  # [M]; 0 while m_i is still -inf
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vb + offset * stride_vt
        v = tl.load(
            v_base + v_off[:, None] + offs_d[None, :],
            mask=in_ctx[:, None] & d_mask[None, :],
            other=0.0,
        )  # [N, Dp]
        # p rounded to the input dtype, as FlashAttention does (a no-op for float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def decode_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache,  # [NB, Hkv, BS, D]
    v_cache,
    block_tables,  # [B, max_blocks]
    entry_row,  # [E] int32: the row (block table) of each decode entry
    entry_tok,  # [E] int32: its query token in the flat batch
    entry_len,  # [E] int32: its context length (the query sits at entry_len - 1)
    part_acc,  # [E, H, P, Dp] float32 (split only)
    part_ml,  # [2, E, H, P] float32: max and sum (split only)
    sinks_ptr,  # [H] sink logits (HAS_SINKS; else any tensor, never read)
    num_parts,
    scale,
    cap,
    window,
    partition_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(entry_row + e).to(tl.int64)
    tok = tl.load(entry_tok + e).to(tl.int64)
    ctx = tl.load(entry_len + e)
    lo = ctx * 0
    if HAS_WINDOW:  # the query at ctx - 1 sees keys > ctx - 1 - window
        lo = tl.maximum(ctx - window, 0)
    start = lo + part * partition_size
    end = tl.minimum(start + partition_size, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = (kvh * GROUP + offs_g).to(tl.int64)  # [G]
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G, Dp]
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:  # partition 0 starts from the sink: m = sink, l = e^0
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")).to(tl.float32)
        first = g_mask & (part == 0)
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    kvh64 = kvh.to(tl.int64)
    acc, m_i, l_i = _attend_range(
        acc,
        m_i,
        l_i,
        q,
        k_cache + kvh64 * stride_kh,
        v_cache + kvh64 * stride_vh,
        block_tables + row * stride_bt,
        start,
        end,
        m_i,  # q_pos: unused (no per-key mask; the range is the window)
        window,
        scale,
        cap,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        BLOCK_SIZE,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_N,
        False,
        False,
        HAS_CAP,
        DOT_PRECISION,
    )
    if SPLIT:
        slot = (e * (GROUP * tl.num_programs(1)) + heads) * num_parts + part  # [G]
        tl.store(
            part_acc + slot[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=g_mask[:, None]
        )
        plane = tl.num_programs(0) * GROUP * tl.num_programs(1) * num_parts
        tl.store(part_ml + slot, m_i, mask=g_mask)
        tl.store(part_ml + plane + slot, l_i, mask=g_mask)
    else:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def reduce_kernel(
    out_ptr,  # [T, H, D]
    part_acc,  # [E, H, P, Dp] float32
    part_ml,  # [2, E, H, P] float32
    entry_tok,  # [E] int32
    num_parts,
    stride_ot,
    stride_oh,
    PARTS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Merge one (entry, head)'s partitions: ``sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p``
    (an empty partition has ``m = -inf``, weight 0; the first is never empty)."""
    e = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = offs_p < num_parts
    base = ((e * tl.num_programs(1) + h) * num_parts).to(tl.int64)  # x Dp may pass 2^31
    plane = tl.num_programs(0) * tl.num_programs(1) * num_parts
    m = tl.load(part_ml + base + offs_p, mask=p_mask, other=float("-inf"))
    l_p = tl.load(part_ml + plane + base + offs_p, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - m_max)  # [P]
    acc = tl.load(
        part_acc + (base + offs_p[:, None]) * HEAD_DIM_PAD + offs_d[None, :],
        mask=p_mask[:, None],
        other=0.0,
    )  # [P, Dp]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(w * l_p, axis=0)  # [Dp]
    tok = tl.load(entry_tok + e).to(tl.int64)
    tl.store(
        out_ptr + tok * stride_ot + h.to(tl.int64) * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache,  # [NB, Hkv, BS, D]
    v_cache,
    block_tables,  # [B, max_blocks]
    query_start_loc,  # [B + 1] int32
    seq_lens,  # [B] int32
    tile_row,  # [n] int32: the row of each query tile
    tile_q0,  # [n] int32: its first query, counted from the row's first query
    sinks_ptr,  # [H] sink logits (HAS_SINKS; else any tensor, never read)
    scale,
    cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(tile_row + t).to(tl.int64)
    q0 = tl.load(tile_q0 + t)
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    ctx = tl.load(seq_lens + row)

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)  # BLOCK_M rows: query-major, the group's heads
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    qi = q0 + offs_m // BLOCK_G  # [M] query index in the row
    g = offs_m % BLOCK_G
    m_mask = (qi < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx - q_len + qi  # [M] absolute positions (past L - 1 on padded slots: unused)
    tok = (q_start + qi).to(tl.int64)
    heads = (kvh * GROUP + g).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [M, Dp]
    first = ctx - q_len + q0
    hi = tl.minimum(first + BLOCK_Q, ctx)  # keys past the tile's last query are never seen
    lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:  # every query starts from its head's sink: m = sink, l = e^0
        sink = tl.load(sinks_ptr + heads, mask=m_mask, other=float("-inf")).to(tl.float32)
        m_i = tl.where(m_mask, sink, m_i)
        l_i = tl.where(m_mask, 1.0, l_i)
    kvh64 = kvh.to(tl.int64)
    acc, m_i, l_i = _attend_range(
        acc,
        m_i,
        l_i,
        q,
        k_cache + kvh64 * stride_kh,
        v_cache + kvh64 * stride_vh,
        block_tables + row * stride_bt,
        lo,
        hi,
        q_pos,
        window,
        scale,
        cap,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        BLOCK_SIZE,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_N,
        True,
        HAS_WINDOW,
        HAS_CAP,
        DOT_PRECISION,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
