"""The SDPA paths of paged attention (the TORCH_SDPA backend's) equal the per-request
reference on random block tables; the metadata's row split and bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.paged import (
    AttentionMetadata,
    GatherWorkspace,
    paged_attention,
    reference_paged_attention,
    write_kv,
)
from kvserve.attention.selector import select_attention_backend
from kvserve.config import AttentionBackendEnum
from tests.attention.utils import CPU, backend, build_batch, cpu_backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_path_equals_reference(dtype: torch.dtype, seed: int) -> None:
    # A mix of decode rows (query 1) of varied lengths and prefill / chunked-prefill rows.
    seq_lens = [1, 17, 33, 5, 64, 40, 9]
    query_lens = [1, 1, 1, 5, 1, 8, 9]
    q, kc, vc, md = build_batch(seq_lens, query_lens, 8, 64, 4, 2, 16, dtype, seed)
    ref = reference_paged_attention(q, kc, vc, md, scale=0.25)
    fast = paged_attention(q, kc, vc, md, scale=0.25)
    md.split_rows(GatherWorkspace())  # the runner's path: gathers into reused buffers
    torch.testing.assert_close(paged_attention(q, kc, vc, md, scale=0.25), fast, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    assert md.decode is not None and md.decode.token_idx is not None
    assert md.decode.token_idx.tolist() == [0, 1, 2, 8]  # rows 0, 1, 2, 4 in the flat batch
    assert md.prefill_rows == []  # rows 3, 5, 6 are batched (row 3 a lone fresh prompt)
    assert sorted(r for g in md.context_groups for r in g.rows) == [3, 5, 6]
    md.split_rows(GatherWorkspace(), batch_context=False)  # the old path: the per-row loop
    assert md.prefill_rows == [3, 5, 6] and md.context_groups == []
    torch.testing.assert_close(paged_attention(q, kc, vc, md, scale=0.25), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_of_one_length_share_a_call(dtype: torch.dtype) -> None:
    # Rows 0, 1, 3 and 6 are fresh 6-token prompts (3 and 6 apart from the first two), rows 2
    # and 5 fresh 11-token ones, row 4 a chunk after cached context, row 7 a lone 3-token prompt.
    seq_lens = [6, 6, 11, 6, 20, 11, 6, 3, 30]
    query_lens = [6, 6, 11, 6, 7, 11, 6, 3, 1]
    q, kc, vc, md = build_batch(seq_lens, query_lens, 4, 64, 8, 2, 32, dtype, 3)
    ref = reference_paged_attention(q, kc, vc, md, scale=0.2)
    md.split_rows()
    assert md.prefill_rows == []
    assert [g.rows for g in md.context_groups] == [[4, 7]]  # the chunk and the lone prompt
    lens = [g.length for g in md.prefill_groups]
    assert lens == [6, 11]
    six, eleven = md.prefill_groups
    qsl = md.query_start_loc
    assert six.tokens.tolist() == [  # type: ignore[union-attr]
        p for i in (0, 1, 3, 6) for p in range(qsl[i], qsl[i + 1])
    ]
    assert eleven.tokens.tolist() == [  # type: ignore[union-attr]
        p for i in (2, 5) for p in range(qsl[i], qsl[i + 1])
    ]
    fast = paged_attention(q, kc, vc, md, scale=0.2)
    grouped = torch.cat([six.tokens, eleven.tokens])  # type: ignore[list-item]
    # Batched fresh prompts run SDPA on the reference's sizes and mask: the same bits.
    torch.testing.assert_close(fast[grouped], ref[grouped], atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


# A step with every kind of row: decode rows (0, 6), a fresh-prompt group (1, 5), a lone fresh
# prompt (9) and chunks after cached context (2, 3, 4, 7, 8), some past 512 keys (SDPA's CPU
# key block) and some padded. Buckets by size: [2] alone, [3, 4] (keys padded to 700), and
# [7, 8, 9] (queries padded to 13, keys to 40).
MIXED_SEQ = [40, 9, 1300, 700, 690, 9, 75, 40, 36, 13]
MIXED_Q = [1, 9, 200, 64, 64, 9, 1, 8, 5, 13]
MIXED_GROUPS = [[2], [3, 4], [7, 8, 9]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("h", "hkv", "d", "block_size"), [(8, 2, 64, 16), (8, 2, 64, 24), (4, 4, 32, 5)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_context_rows_equal_reference(
    dtype: torch.dtype, h: int, hkv: int, d: int, block_size: int, seed: int
) -> None:
    """Chunks after cached context, batched in padded groups, against the per-row loop."""
    args = (block_size, 1000, h, hkv, d, dtype, seed)
    q, kc, vc, md = build_batch(MIXED_SEQ, MIXED_Q, *args)
    scale = d**-0.5
    ref = reference_paged_attention(q, kc, vc, md, scale)
    fast = paged_attention(q, kc, vc, md, scale)  # splits rows itself, no workspace
    assert [g.rows for g in md.context_groups] == MIXED_GROUPS and md.prefill_rows == []
    assert [g.length for g in md.prefill_groups] == [9]
    assert md.decode is not None and md.decode.token_idx is not None
    assert md.decode.token_idx.tolist() == [0, 347]  # rows 0 and 6 in the flat batch
    for g in md.context_groups:  # every query, padded or not, sees a key: no NaN
        assert bool(g.mask.any(dim=-1).all())
    assert torch.isfinite(fast).all()
    md.split_rows(GatherWorkspace())  # the runner's path: decode and context share buffers
    torch.testing.assert_close(paged_attention(q, kc, vc, md, scale), fast, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
        return
    # bf16: the padded path may round differently from the loop, but not worse against a
    # float64 reference (measured: mean error ratio 1.000, same max error).
    exact = reference_paged_attention(q.double(), kc.double(), vc.double(), md, scale)
    fast_err, loop_err = (fast.double() - exact).abs(), (ref.double() - exact).abs()
    assert fast_err.mean() <= 1.05 * loop_err.mean()
    assert fast_err.max() <= 1.5 * loop_err.max()


def test_context_group_bookkeeping() -> None:
    """Sizes, padded query slots and the offset-causal mask of the [7, 8, 9] group."""
    q, kc, vc, md = build_batch(MIXED_SEQ, MIXED_Q, 4, 1000, 2, 1, 8, torch.float32, 0)
    md.split_rows()
    g = md.context_groups[2]
    assert (g.q_len, g.kv_len) == (13, 40) and g.blocks.shape == (3 * 10,)
    qsl = md.query_start_loc
    runs = [(qsl[i], qsl[i + 1] - qsl[i]) for i in (7, 8, 9)]  # (first token, Lq) per row
    assert g.tokens == slice(runs[0][0], runs[2][0] + 13)  # rows 7, 8, 9 are adjacent
    # Each row's 13 slots: its queries, then its last query repeated (output dropped).
    expect = [s + min(p, n - 1) for s, n in runs for p in range(13)]
    assert isinstance(g.query_index, torch.Tensor) and g.query_index.tolist() == expect
    assert g.valid is not None
    assert g.valid.tolist() == [r * 13 + p for r, (_, n) in enumerate(runs) for p in range(n)]
    # Row 8 (L 36, Lq 5): query i sits at 31 + i and sees keys 0..31 + i; padded slots
    # (i >= 5) see all 36 keys, never the padding keys 36..39.
    row8 = g.mask[1, 0]  # [13, 40]
    for i in range(13):
        assert row8[i].tolist() == [j <= min(31 + i, 35) for j in range(40)]
    assert g.mask.shape == (3, 1, 13, 40)
    torch.testing.assert_close(
        paged_attention(q, kc, vc, md, 0.3), reference_paged_attention(q, kc, vc, md, 0.3)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_context_groups_are_exact(dtype: torch.dtype) -> None:
    """A group of one row, or of rows of equal sizes, runs SDPA on the loop's own sizes, so a
    long prompt's chunks give the same bits as before batching (one mask shared by the rows)."""
    for seq_lens, q_lens in (([1300], [200]), ([600, 600, 600], [50, 50, 50])):
        q, kc, vc, md = build_batch(seq_lens, q_lens, 16, 200, 8, 2, 64, dtype, 7)
        ref = reference_paged_attention(q, kc, vc, md, 0.125)
        md.split_rows(GatherWorkspace())
        (g,) = md.context_groups
        assert g.valid is None and g.query_index == slice(0, sum(q_lens))
        assert g.mask.shape == (1, 1, q_lens[0], seq_lens[0])
        torch.testing.assert_close(paged_attention(q, kc, vc, md, 0.125), ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_keys_holding_nan_do_not_leak(dtype: torch.dtype) -> None:
    """Every cache slot outside the rows' contexts holds NaN (as a reused block could, after a
    request whose K/V overflowed): padded context groups still equal the loop, which reads
    only each row's first L tokens."""
    seq_lens, q_lens = [1300, 700, 690, 40, 36, 13, 9, 9], [200, 64, 64, 8, 5, 13, 9, 9]
    q, kc, vc, md = build_batch(seq_lens, q_lens, 16, 400, 8, 2, 64, dtype, 2)
    used = torch.zeros(400 * 16, dtype=torch.bool)  # per slot: in some row's context
    for i, length in enumerate(seq_lens):
        pos = torch.arange(length)
        used[md.block_tables[i, pos // 16] * 16 + pos % 16] = True
    unused = ~used.view(400, 16)  # [num_blocks, bs]
    kc.masked_fill_(unused[:, None, :, None], float("nan"))  # [num_blocks, Hkv, bs, D]
    vc.masked_fill_(unused[:, None, :, None], float("nan"))
    ref = reference_paged_attention(q, kc, vc, md, 0.125)
    md.split_rows(GatherWorkspace())
    assert any(g.pad_keys is not None for g in md.context_groups)
    fast = paged_attention(q, kc, vc, md, 0.125)
    assert torch.isfinite(fast).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


def test_adjacent_fresh_prompts_are_a_slice() -> None:
    q, kc, vc, md = build_batch([5, 5, 5], [5, 5, 5], 4, 16, 4, 2, 16, torch.float32, 4)
    ref = reference_paged_attention(q, kc, vc, md, scale=0.3)
    md.split_rows()
    assert md.prefill_rows == [] and len(md.prefill_groups) == 1
    assert md.prefill_groups[0].tokens == slice(0, 15)
    torch.testing.assert_close(paged_attention(q, kc, vc, md, 0.3), ref, atol=0, rtol=0)


def test_all_decode_batch_skips_indexing() -> None:
    q, kc, vc, md = build_batch([3, 20, 9], [1, 1, 1], 4, 16, 4, 2, 8, torch.float32, 9)
    fast = paged_attention(q, kc, vc, md, scale=0.3)
    assert md.decode is not None and md.decode.token_idx is None
    assert md.decode.block_tables.shape == (3, 5)
    torch.testing.assert_close(fast, reference_paged_attention(q, kc, vc, md, 0.3))


def test_reference_equals_dense_causal_attention() -> None:
    """One request whose blocks are scrambled equals plain causal SDPA on its tokens."""
    q, kc, vc, md = build_batch([13], [13], 4, 8, 2, 1, 8, torch.float32, 5)
    table = md.block_tables[0]
    pos = torch.arange(13)
    k = kc[table[pos // 4], :, pos % 4]  # [13, 1, 8]: token p in block p // 4, offset p % 4
    v = vc[table[pos // 4], :, pos % 4]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).expand(2, 13, 8),
        v.transpose(0, 1).expand(2, 13, 8),
        is_causal=True,
        scale=0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(reference_paged_attention(q, kc, vc, md, 0.5), dense)


def test_write_kv_layout() -> None:
    """Cache layout [num_blocks, Hkv, block_size, D]: slot s, head h -> [s // bs, h, s % bs]."""
    kc, vc = torch.zeros(3, 2, 4, 5), torch.zeros(3, 2, 4, 5)
    k = torch.arange(2 * 2 * 5, dtype=torch.float32).view(2, 2, 5) + 1  # [T=2, Hkv=2, D=5]
    write_kv(k, -k, kc, vc, torch.tensor([6, 1]))  # block 1 offset 2; block 0 offset 1
    assert torch.equal(kc[1, :, 2], k[0]) and torch.equal(kc[0, :, 1], k[1])
    assert torch.equal(vc[1, :, 2], -k[0]) and torch.equal(vc[0, :, 1], -k[1])
    assert int((kc != 0).any(dim=-1).sum()) == 4  # 2 tokens x 2 heads, nothing else


def test_gather_workspace_grows_and_reuses() -> None:
    ws = GatherWorkspace()
    like = torch.empty(0, dtype=torch.bfloat16)
    a = ws.get(0, (4, 8), like)
    b = ws.get(0, (2, 8), like)  # smaller: same storage
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8)
    c = ws.get(0, (10, 8), like)  # larger: grown
    assert c.shape == (10, 8) and c.dtype == torch.bfloat16
    assert ws.get(1, (3,), like).data_ptr() != c.data_ptr()  # separate buffers per index


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_rows_attend_as_decode_rows(use_kernel: bool, dtype: torch.dtype) -> None:
    """Verification rows (the last token plus k proposals) go to the decode batch, one entry
    per query, and equal the reference; the other rows keep their paths."""
    if use_kernel and len(cpu_backends()) == 1:
        pytest.skip("no C++ compiler")
    b = backend(use_kernel)
    seq_lens = [21, 17, 40, 6, 33]
    query_lens = [5, 1, 8, 6, 3]
    q, kc, vc, md = build_batch(seq_lens, query_lens, 8, 64, 4, 2, 16, dtype, seed=3)
    md.spec_rows = frozenset({0, 4})
    b.build_metadata(md)
    assert md.decode is not None
    # rows 0 (5 queries), 1 (1) and 4 (3): 9 entries with their own context lengths
    assert md.decode.seq_lens.tolist() == [17, 18, 19, 20, 21, 17, 31, 32, 33]
    assert md.decode.token_idx is not None
    assert md.decode.token_idx.tolist() == [0, 1, 2, 3, 4, 5, 20, 21, 22]
    # the chunk after context (row 2) and the fresh prompt (row 3) keep the prefill paths
    assert [g.rows for g in md.context_groups] == [[2, 3]]
    fast = b.forward(q, kc, vc, md, scale=0.25)
    ref = reference_paged_attention(q, kc, vc, md, scale=0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


def test_spec_row_queries_equal_one_token_steps() -> None:
    """Query j of a verification row gets exactly the numbers of a one-token decode row with
    that context (same kernel, same inputs): speculation cannot change greedy tokens here."""
    q, kc, vc, md = build_batch([30], [4], 8, 16, 4, 2, 16, torch.float32, seed=5)
    md.spec_rows = frozenset({0})
    b = select_attention_backend(AttentionBackendEnum.AUTO, CPU, torch.float32, 16)
    fast = b.forward(q, kc, vc, b.build_metadata(md), scale=0.25)
    for j in range(4):
        one = AttentionMetadata(
            slot_mapping=md.slot_mapping[j : j + 1],
            query_start_loc=[0, 1],
            seq_lens=[27 + j],
            block_tables=md.block_tables,
            block_size=8,
        )
        alone = b.forward(q[j : j + 1], kc, vc, b.build_metadata(one), scale=0.25)
        torch.testing.assert_close(fast[j : j + 1], alone, atol=0, rtol=0)


def test_spec_row_beside_a_prefill_row_is_indexed() -> None:
    """A verification row of 2 queries and one prefill row: 2 decode entries for 2 rows must
    not be taken for an all-decode batch (row i = token i)."""
    q, kc, vc, md = build_batch([12, 5], [2, 5], 4, 16, 4, 2, 16, torch.float32, seed=6)
    md.spec_rows = frozenset({0})
    b = select_attention_backend(AttentionBackendEnum.AUTO, CPU, torch.float32, 16)
    b.build_metadata(md)
    assert md.decode is not None and md.decode.token_idx is not None
    assert md.decode.token_idx.tolist() == [0, 1]
    torch.testing.assert_close(
        b.forward(q, kc, vc, md, scale=0.25),
        reference_paged_attention(q, kc, vc, md, scale=0.25),
        atol=1e-5,
        rtol=1e-5,
    )
