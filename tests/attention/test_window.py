"""Sliding-window and soft-capped paged attention: the reference against transformers' own
definitions, and every fast path (C++ decode kernel, SDPA decode, fresh-prompt groups, padded
context groups, speculative rows) against the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from kvserve.attention import prefill
from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.paged import AttentionMetadata, paged_attention, reference_paged_attention
from kvserve.attention.selector import select_attention_backend
from kvserve.config import AttentionBackendEnum
from tests.attention.utils import CPU, HAS_COMPILER, backend, build_batch

needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")


class _EagerModule(nn.Module):
    """The attributes transformers' ``eager_attention_forward`` reads from its attention."""

    def __init__(self, groups: int, head_dim: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.head_dim = groups, head_dim
        self.eval()


@pytest.mark.parametrize(("window", "soft_cap"), [(4, None), (6, 2.0), (None, 1.5), (40, 3.0)])
def test_reference_equals_transformers_eager(window: int | None, soft_cap: float | None) -> None:
    """One request of 13 tokens, 5 of them queries after 8 cached, on scrambled blocks:
    Gemma 2's eager attention (float64) with transformers' sliding-window causal mask."""
    q, kc, vc, md = build_batch([13], [5], 4, 8, 4, 2, 8, torch.float64, 5)
    pos = torch.arange(13)
    table = md.block_tables[0]
    k = kc[table[pos // 4], :, pos % 4].transpose(0, 1)[None]  # [1, 2, 13, 8]
    v = vc[table[pos // 4], :, pos % 4].transpose(0, 1)[None]
    q_pos, kv_pos = torch.arange(8, 13)[:, None], torch.arange(13)[None, :]
    if window is None:
        allowed = kv_pos <= q_pos  # [5, 13]
    else:
        allowed = sliding_window_causal_mask_function(window)(0, 0, q_pos, kv_pos)
    additive = torch.zeros(1, 1, 5, 13, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    expect, _ = eager_attention_forward(
        _EagerModule(2, 8),
        q.transpose(0, 1)[None],  # [1, 4, 5, 8]
        k,
        v,
        additive,
        scaling=0.7,
        softcap=soft_cap,
    )  # [1, 5, 4, 8]
    got = reference_paged_attention(q, kc, vc, md, 0.7, sliding_window=window, soft_cap=soft_cap)
    # transformers' softmax runs in float32 whatever the input dtype
    torch.testing.assert_close(got, expect[0], atol=1e-6, rtol=1e-6)


# Decode rows (0, 6), spec rows (10: 4 queries, 11: 3), a fresh-prompt group (1, 5), a lone
# fresh prompt (9) and chunks after cached context (2, 3, 4, 7, 8), padded in groups.
SEQ = [40, 9, 300, 130, 125, 9, 75, 40, 36, 13, 61, 20]
QLEN = [1, 9, 50, 20, 20, 9, 1, 8, 5, 13, 4, 3]
# Windows smaller than any context, not aligned to block_size 8, equal to the block size,
# equal to a row's context (40, 130), and larger than every context.
WINDOWS = [1, 5, 8, 11, 40, 130, 1000]


def _check(fast: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(fast).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_every_path_equals_reference(
    use_kernel: bool, dtype: torch.dtype, d: int, soft_cap: float | None
) -> None:
    if use_kernel and not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, kc, vc, md = build_batch(SEQ, QLEN, 8, 400, 8, 2, d, dtype, seed=d)
    md.spec_rows = frozenset({10, 11})
    b = backend(use_kernel)
    b.build_metadata(md)
    assert [g.length for g in md.prefill_groups] == [9]
    assert sorted(r for g in md.context_groups for r in g.rows) == [2, 3, 4, 7, 8, 9]
    assert any(g.valid is not None for g in md.context_groups)  # a padded group
    assert md.decode is not None and md.decode.seq_lens.numel() == 2 + 4 + 3
    for window in [None, *WINDOWS]:
        ref = reference_paged_attention(
            q, kc, vc, md, d**-0.5, sliding_window=window, soft_cap=soft_cap
        )
        fast = b.forward(q, kc, vc, md, d**-0.5, sliding_window=window, soft_cap=soft_cap)
        _check(fast, ref, dtype)
        if soft_cap is None and window is not None and window < 130:
            plain = reference_paged_attention(q, kc, vc, md, d**-0.5)
            assert not torch.allclose(ref, plain, atol=0.05)  # the window changed something


def test_window_and_soft_cap_follow_each_call() -> None:
    """One step's metadata serves layers with different windows and caps (Gemma 2
    alternates sliding and global layers): each call gets its own, in any order."""
    q, kc, vc, md = build_batch(SEQ, QLEN, 8, 400, 8, 2, 32, torch.float32, seed=1)
    b = backend(use_kernel=False)
    b.build_metadata(md)
    for window, cap in [(5, None), (None, None), (11, 3.0), (5, None), (None, 3.0), (11, None)]:
        ref = reference_paged_attention(q, kc, vc, md, 0.2, sliding_window=window, soft_cap=cap)
        _check(b.forward(q, kc, vc, md, 0.2, sliding_window=window, soft_cap=cap), ref, q.dtype)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_past_every_context_changes_no_bit(use_kernel: bool, dtype: torch.dtype) -> None:
    """A window at least every context (and None passed explicitly) gives exactly the
    output of a call without one, on every path."""
    if use_kernel and not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, kc, vc, md = build_batch(SEQ, QLEN, 8, 400, 8, 2, 64, dtype, seed=4)
    md.spec_rows = frozenset({10})
    b = backend(use_kernel)
    b.build_metadata(md)
    plain = b.forward(q, kc, vc, md, 0.125)
    for window in (None, 300, 301, 4096):
        got = b.forward(q, kc, vc, md, 0.125, sliding_window=window, soft_cap=None)
        torch.testing.assert_close(got, plain, atol=0, rtol=0)
    ref = reference_paged_attention(q, kc, vc, md, 0.125)
    torch.testing.assert_close(
        reference_paged_attention(q, kc, vc, md, 0.125, sliding_window=300), ref, atol=0, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_group_with_window_is_exact(dtype: torch.dtype) -> None:
    """Fresh prompts of one length run SDPA on the reference's sizes and windowed mask."""
    q, kc, vc, md = build_batch([30, 30, 30], [30, 30, 30], 8, 64, 4, 2, 32, dtype, seed=2)
    md.split_rows()
    assert len(md.prefill_groups) == 1 and md.context_groups == []
    for window in (1, 7, 29, 30):
        ref = reference_paged_attention(q, kc, vc, md, 0.3, sliding_window=window)
        fast = paged_attention(q, kc, vc, md, 0.3, sliding_window=window)
        torch.testing.assert_close(fast, ref, atol=0, rtol=0)
    mask = md.prefill_groups[0].window_mask(7)  # [30, 30]
    for i in range(30):
        assert mask[i].tolist() == [i - 7 < j <= i for j in range(30)]


def test_context_group_window_mask() -> None:
    """Row 8 of the [7, 8, 9] group (L 36, Lq 5, padded to 13 queries over 40 keys): query i
    at position 31 + i sees keys 31 + i - w < j <= 31 + i; padded slots see the last w keys of
    its 36, never the padding keys 36..39."""
    seq, qlen = [40, 9, 1300, 700, 690, 9, 75, 40, 36, 13], [1, 9, 200, 64, 64, 9, 1, 8, 5, 13]
    q, kc, vc, md = build_batch(seq, qlen, 4, 1000, 2, 1, 8, torch.float32, 0)
    md.split_rows()
    g = md.context_groups[2]
    assert g.rows == [7, 8, 9] and (g.q_len, g.kv_len) == (13, 40)
    w = 6
    row8 = g.window_mask(w)[1, 0]  # [13, 40]
    for i in range(13):
        pos = min(31 + i, 35)
        assert row8[i].tolist() == [pos - w < j <= pos for j in range(40)]
    assert g.window_mask(w) is g.window_mask(w)  # built once, shared by the layers
    additive = g.additive_mask(torch.float32, w)
    assert torch.equal(additive == 0, g.window_mask(w))
    torch.testing.assert_close(
        paged_attention(q, kc, vc, md, 0.3, sliding_window=w),
        reference_paged_attention(q, kc, vc, md, 0.3, sliding_window=w),
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "block_size"), [(64, 16), (128, 16), (32, 8), (64, 24)])
def test_kernel_never_reads_before_the_window(dtype: torch.dtype, d: int, block_size: int) -> None:
    """Every cached token before a row's window holds NaN: the kernel skips the blocks before
    the window and starts the partial one at the window's first token, so its output is
    finite and equals the reference on the clean cache."""
    seq = [1, 17, 33, 5, 64, 40, 9, 70, 300, 129]
    q, kc, vc, md = build_batch(seq, [1] * len(seq), block_size, 400, 8, 2, d, dtype, seed=6)
    for window, cap in ((5, None), (block_size, 2.5), (37, None), (37, 2.5)):
        ref = reference_paged_attention(q, kc, vc, md, 0.2, sliding_window=window, soft_cap=cap)
        kn, vn = kc.clone(), vc.clone()
        for i, length in enumerate(seq):
            pos = torch.arange(max(0, length - window))  # tokens before the window
            blocks, offsets = md.block_tables[i, pos // block_size], pos % block_size
            kn[blocks, :, offsets] = float("nan")
            vn[blocks, :, offsets] = float("nan")
        kernel = CpuKernelBackend(CPU)
        kernel.build_metadata(md)
        fast = kernel.forward(q, kn, vn, md, 0.2, sliding_window=window, soft_cap=cap)
        _check(fast, ref, dtype)


def test_soft_cap_in_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft-cap path splits long query runs to bound its float32 scores; the split
    does not change the result."""
    q, kc, vc, md = build_batch([200, 150], [120, 150], 16, 64, 4, 2, 32, torch.float32, 3)
    b = backend(use_kernel=False)
    b.build_metadata(md)
    whole = b.forward(q, kc, vc, md, 0.2, sliding_window=50, soft_cap=5.0)
    monkeypatch.setattr(prefill, "SOFTCAP_CHUNK_BYTES", 4 * 2 * 4 * 200 * 7)
    chunked = b.forward(q, kc, vc, md, 0.2, sliding_window=50, soft_cap=5.0)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    ref = reference_paged_attention(q, kc, vc, md, 0.2, sliding_window=50, soft_cap=5.0)
    torch.testing.assert_close(chunked, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"sliding_window": 2.5}, "sliding_window"),
        ({"sliding_window": True}, "sliding_window"),
        ({"soft_cap": 0.0}, "soft_cap"),
        ({"soft_cap": -30.0}, "soft_cap"),
        ({"soft_cap": float("nan")}, "soft_cap"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], match: str) -> None:
    q, kc, vc, md = build_batch([5], [1], 4, 8, 2, 1, 16, torch.float32, 0)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, kc, vc, md, 0.5, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        reference_paged_attention(q, kc, vc, md, 0.5, **kwargs)  # type: ignore[arg-type]


def test_spec_row_with_window_equals_one_token_steps() -> None:
    """Query j of a verification row, windowed, gets the numbers of a one-token step."""
    q, kc, vc, md = build_batch([30], [4], 8, 16, 4, 2, 16, torch.float32, seed=5)
    md.spec_rows = frozenset({0})
    b = select_attention_backend(AttentionBackendEnum.AUTO, CPU, torch.float32, 16)
    b.build_metadata(md)
    fast = b.forward(q, kc, vc, md, 0.25, sliding_window=9, soft_cap=2.0)
    for j in range(4):
        one = AttentionMetadata(
            slot_mapping=md.slot_mapping[j : j + 1],
            query_start_loc=[0, 1],
            seq_lens=[27 + j],
            block_tables=md.block_tables,
            block_size=8,
        )
        b.build_metadata(one)
        alone = b.forward(q[j : j + 1], kc, vc, one, 0.25, sliding_window=9, soft_cap=2.0)
        torch.testing.assert_close(fast[j : j + 1], alone, atol=0, rtol=0)
