"""The Triton paged-attention kernels against ``reference_paged_attention``.

Without CUDA they run in Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` before anything imports them); with CUDA the ``cuda`` cases run the
compiled kernels. The interpreter costs ~3 ms per program, so every launch here is a few tens
of programs: small contexts, with small tiles and partitions so that they still cross several
tiles, cache blocks and split-K partitions.

Every cache slot outside some row's context holds NaN: a kernel that reads a slot it should
not (a hole of a block table, the tail of a last block, a padded table entry) gets NaN.

Tolerances: float32 agrees to a few float32 ulps of outputs of magnitude up to ~4 (the same
sums in another order and the online softmax's rescaling; measured max 1.2e-6, the
reference's own error against float64 up to 6.5e-7), so
atol = rtol = 2e-5. float16 rounds the probabilities to float16 before ``p @ v`` as
FlashAttention does (relative 2^-11 each) and the output to float16 (an ulp is 2^-10 near
1-2): measured max 9.8e-4 (one ulp; against float64 the kernels err 9.4e-4 at most, the
reference as much), so atol = rtol = 3e-3. bfloat16 (CUDA only: the interpreter
computes bfloat16 ``tl.dot`` wrongly, triton-lang/triton#11584) has 8 bits of mantissa:
atol = rtol = 3e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.paged import AttentionMetadata, reference_paged_attention
from kvserve.ops.triton.paged_attention import (
    STATIC_MAX_PARTS,
    KernelTuning,
    decode_partition_size,
    interpreted,
    paged_decode_attention,
    plan_attention,
    run_attention,
    static_decode_plan,
    tile_keys,
    triton_paged_attention,
)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# Small tiles so that short contexts still span several tiles and partitions.
SMALL = KernelTuning(partition_size=32, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.cuda, id="bfloat16"),
]


@pytest.fixture
def dev(device: torch.device, request: pytest.FixtureRequest) -> torch.device:
    """The device fixture, with the cases these kernels cannot run skipped with the reason."""
    if device.type == "cpu" and not interpreted():
        pytest.skip("kernels compiled for CUDA (TRITON_INTERPRET unset): no CPU tensors")
    dtype = request.node.callspec.params.get("dtype")
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly (triton#11584)")
    return device


def make_batch(
    lens: list[int],
    qlens: list[int],
    heads: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    head_dim: int = 32,
    block_size: int = 8,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q ``[T, H, D]``, caches ``[NB, Hkv, BS, D]`` and metadata for rows of context ``lens``
    with ``qlens`` queries each. Block tables take blocks from a shuffled pool twice the
    needed size (holes, any order) and are padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    need = [-(-n // block_size) for n in lens]
    nb = 2 * sum(need) + 1
    pool = torch.randperm(nb, generator=g).tolist()
    k = torch.full((nb, hkv, block_size, head_dim), float("nan"))
    v = torch.full((nb, hkv, block_size, head_dim), float("nan"))
    tables = []
    for n, m in zip(lens, need, strict=True):
        blocks, pool = pool[:m], pool[m:]
        tables.append(blocks + [0] * (max(need) - m))
        for p in range(n):  # only the slots of the context get values
            b, o = blocks[p // block_size], p % block_size
            k[b, :, o] = torch.randn(hkv, head_dim, generator=g)
            v[b, :, o] = torch.randn(hkv, head_dim, generator=g)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], h, head_dim, generator=g)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        query_start_loc=qsl,
        seq_lens=list(lens),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        block_size=block_size,
    )
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), md


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: AttentionMetadata,
    tuning: KernelTuning = SMALL,
    **opts: float | int | torch.Tensor | None,
) -> torch.Tensor:
    """The kernels' output equals the reference's within the dtype's tolerance."""
    scale = q.shape[-1] ** -0.5
    want = reference_paged_attention(q, k, v, md, scale, **opts)
    got = triton_paged_attention(q, k, v, md, scale, tuning=tuning, **opts)
    tol = TOL[q.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return got


def test_interpreter_on_without_cuda() -> None:
    """The switch in tests/conftest.py took effect before the kernels were decorated."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are compiled")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert interpreted()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_decode_gqa_split_k(heads: tuple[int, int], dtype: torch.dtype, dev: torch.device) -> None:
    """Decode rows of 1 to 77 tokens: 77 spans three 32-token partitions (split-K + reduce),
    40 two, 9 one (no reduce for its partition alone), across 8-token blocks."""
    check(*make_batch([1, 9, 40, 77], [1, 1, 1, 1], heads, dtype, dev))


def test_decode_single_partition_no_reduce(dev: torch.device) -> None:
    """Contexts within one partition take the direct path (no split buffers, no reduce)."""
    check(*make_batch([5, 30, 16], [1, 1, 1], (4, 2), torch.float32, dev))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_fresh_chunked_and_cached(dtype: torch.dtype, dev: torch.device) -> None:
    """One launch: a fresh prompt (21 of 21), a chunk after 37 cached tokens (13 of 50), a
    prefix-cache hit (5 of 37), with GQA 4 and 4 queries per program."""
    check(*make_batch([21, 50, 37], [21, 13, 5], (8, 2), dtype, dev))


@pytest.mark.parametrize(
    ("window", "cap"),
    [(None, 1.0), (1, None), (6, None), (20, 0.5), (200, None)],
    ids=["cap", "window1", "window6", "window20-cap", "window-past-context"],
)
def test_mixed_batch_windows_soft_caps(
    window: int | None, cap: float | None, dev: torch.device
) -> None:
    """Decode (one of 70 tokens: three partitions, the window keeps fewer), a chunk after
    cached context, a fresh prompt and a verification row in one call, head_dim 24 (padded to
    32 in the kernels). A soft-cap of 0.5-1 changes nearly every score (they are ~N(0, 1))."""
    q, k, v, md = make_batch([70, 45, 12, 33], [1, 9, 12, 4], (4, 1), torch.float32, dev,
                             head_dim=24)  # fmt: skip
    got = check(q, k, v, md, sliding_window=window, soft_cap=cap)
    plain = reference_paged_attention(q, k, v, md, q.shape[-1] ** -0.5)
    if window != 200:  # the option mattered: the outputs differ from plain attention
        assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_mixed_batch_sinks(window: int | None, dev: torch.device) -> None:
    """gpt-oss's attention sinks in both kernels: a split-K decode row (70 tokens, three
    partitions: only partition 0 starts from the sink), a chunk after cached context, a fresh
    prompt and a verification row, 8 heads over 2 KV heads (each GQA group reads its own
    sinks), against the reference; a sink of 6 outweighs every key of its head."""
    q, k, v, md = make_batch([70, 45, 12, 33], [1, 9, 12, 4], (8, 2), torch.float32, dev,
                             head_dim=16)  # fmt: skip
    sinks = torch.tensor([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0], device=dev)
    got = check(q, k, v, md, sliding_window=window, sinks=sinks)  # type: ignore[arg-type]
    plain = reference_paged_attention(q, k, v, md, q.shape[-1] ** -0.5, sliding_window=window)
    assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("spec", [True, False], ids=["decode-kernel", "prefill-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verification_rows(spec: bool, dtype: torch.dtype, dev: torch.device) -> None:
    """Rows with a few queries at the end of their context (speculative verification): as
    ``spec_rows`` they are one decode entry per query (the second reaches across a partition
    boundary at 32), otherwise prefill rows; both kernels give the reference's output."""
    q, k, v, md = make_batch([35, 9, 60], [4, 1, 3], (8, 2), dtype, dev)
    if spec:
        md.spec_rows = frozenset({0, 2})
    check(q, k, v, md)
    check(q, k, v, md, sliding_window=7)


def test_rows_subset_leaves_other_tokens(dev: torch.device) -> None:
    """``rows`` and ``out`` as the reference takes them: other tokens keep ``out``'s values.
    Blocks of 5 tokens: nothing assumes a power of two."""
    q, k, v, md = make_batch([10, 20, 30], [1, 5, 1], (4, 2), torch.float32, dev, block_size=5)
    scale = 0.25
    out = torch.full_like(q, 7.0)
    triton_paged_attention(q, k, v, md, scale, rows=[1], out=out, tuning=SMALL)
    want = reference_paged_attention(q, k, v, md, scale, rows=[1], out=torch.full_like(q, 7.0))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert (out[0] == 7.0).all() and (out[6] == 7.0).all()


def test_default_tuning(dev: torch.device) -> None:
    """The production tile sizes (64-token tiles, 512-token partitions) on a mixed batch."""
    check(*make_batch([3, 80, 40], [1, 1, 24], (4, 2), torch.float32, dev), KernelTuning())


def test_small_batch_cuts_smaller_partitions(dev: torch.device) -> None:
    """One request, 2 KV heads, asked for 16 programs: 70 tokens in 16-token partitions (5),
    not one 64-token partition and a remainder; the window case reads only its 20 keys."""
    tuning = KernelTuning(partition_size=64, decode_block_n=16, min_programs=16)
    assert decode_partition_size(1, 2, 70, 16, tuning) == 16
    q, k, v, md = make_batch([70], [1], (8, 2), torch.float32, dev)
    check(q, k, v, md, tuning)
    check(q, k, v, md, tuning, sliding_window=20)


def test_decode_partition_size() -> None:
    """Partitions shrink (powers of two, down to one tile) only while programs are short."""
    t = KernelTuning()  # 512-token partitions, 64-token tiles
    assert decode_partition_size(64, 8, 4096, 264, t) == 512  # 512 programs per partition
    assert decode_partition_size(1, 8, 1024, 264, t) == 32 * 2  # 33 wanted: 1024/33 -> 64
    assert decode_partition_size(1, 8, 8192, 264, t) == 256  # 8192/33 = 249 -> 256
    assert decode_partition_size(1, 8, 100_000, 264, t) == 512  # never above the maximum
    assert decode_partition_size(1, 8, 1024, 0, t) == 512  # no minimum: the maximum


def test_tile_keys() -> None:
    """A K tile holds at most 8 KB (no spills in the sm_90 cubins), at least 16 keys."""
    t = KernelTuning()
    assert tile_keys(64, 64, torch.bfloat16, t) == 64
    assert tile_keys(64, 128, torch.bfloat16, t) == 32
    assert tile_keys(64, 64, torch.float32, t) == 32
    assert tile_keys(64, 256, torch.float32, t) == 16
    assert tile_keys(16, 24, torch.float16, t) == 16


def test_plan_once_run_per_layer(dev: torch.device) -> None:
    """One plan serves every layer: two layers' caches, each equal to the reference."""
    q, k, v, md = make_batch([40, 25, 30], [1, 25, 3], (4, 2), torch.float16, dev)
    md.spec_rows = frozenset({2})
    plan = plan_attention(md, 2, dev, tuning=SMALL)
    scale = q.shape[-1] ** -0.5
    for layer in range(2):
        kl, vl = (k, v) if layer == 0 else (v, k)  # another layer's cache: K and V swapped
        out = torch.empty_like(q)
        run_attention(plan, q, kl, vl, scale, out, soft_cap=2.0, tuning=SMALL)
        want = reference_paged_attention(q, kl, vl, md, scale, soft_cap=2.0)
        torch.testing.assert_close(out, want, atol=3e-3, rtol=3e-3)


def test_lower_level_decode_entries(dev: torch.device) -> None:
    """``paged_decode_attention`` with its own entries: the same query token attended over a
    shorter prefix of the row (as a verification entry would) matches the reference there."""
    q, k, v, md = make_batch([50], [1], (2, 2), torch.float32, dev)
    ints = dict(dtype=torch.int32, device=dev)
    out = torch.zeros_like(q)
    paged_decode_attention(
        out, q, k, v, md.block_tables, torch.tensor([0], **ints), torch.tensor([0], **ints),
        torch.tensor([41], **ints), 0.2, max_len=41, tuning=SMALL,
    )  # fmt: skip
    short = AttentionMetadata(md.slot_mapping, [0, 1], [41], md.block_tables, md.block_size)
    want = reference_paged_attention(q, k, v, short, 0.2)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_decode_plan(dtype: torch.dtype, dev: torch.device) -> None:
    """The plan a CUDA graph replays (device lengths, split-K from the model's limit): the
    eager plan's numbers bit for bit where both cut at the same partition size (the extra
    partitions past every context add exactly 0), and the reference's with fewer, longer
    partitions (``max_parts``)."""
    lens = [40, 9, 23]  # 2, 1 and 1 partitions of 32
    q, k, v, md = make_batch(lens, [1, 1, 1], (4, 2), dtype, dev)
    scale = q.shape[-1] ** -0.5
    eager = torch.empty_like(q)
    run_attention(plan_attention(md, 2, dev, tuning=SMALL), q, k, v, scale, eager, tuning=SMALL)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    for max_parts, parts in ((STATIC_MAX_PARTS, 3), (2, 2)):  # partitions of 32, or of 64
        plan = static_decode_plan(md.block_tables, seq_lens, 96, max_parts)
        assert plan.entry_rows.tolist() == plan.entry_tokens.tolist() == [0, 1, 2]
        out = torch.empty_like(q)
        run_attention(plan, q, k, v, scale, out, tuning=SMALL)
        if parts == 3 and dev.type == "cpu":  # CUDA cuts both at 16 (min_programs); its
            assert torch.equal(out, eager)  # reduce may add 3 partials in another order
        want = reference_paged_attention(q, k, v, md, scale)
        torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_input_is_refused() -> None:
    """Clear errors before any launch (no device needed)."""
    q, k, v, md = make_batch([4], [2], (4, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="sliding_window"):
        triton_paged_attention(q, k, v, md, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        triton_paged_attention(q, k, v, md, 1.0, soft_cap=-1.0)
    with pytest.raises(ValueError, match="query heads"):
        triton_paged_attention(q[:, :3], k, v, md, 1.0)
    with pytest.raises(ValueError, match="share one of"):
        triton_paged_attention(q.half(), k, v, md, 1.0)
    short = AttentionMetadata(md.slot_mapping, [0, 2], [1], md.block_tables, md.block_size)
    with pytest.raises(ValueError, match="context of only 1"):
        triton_paged_attention(q, k, v, short, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        KernelTuning(partition_size=48)
