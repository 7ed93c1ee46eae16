"""The grouped per-row LoRA delta and the C++ kernel against the gathered reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.lora.punica import LoRAMapping, lora_delta_grouped, lora_delta_reference
from kvserve.ops import cpu_kernels


def _weights(
    slots: int, rank: int, k: int, outs: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, len(outs) * rank, k, generator=g)  # [S, n*R, K]
    bs = tuple(torch.randn(slots, rank, n, generator=g) for n in outs)  # [S, R, N_i]
    return a, bs


@pytest.mark.parametrize(
    ("row_slots", "counts"),
    [
        ([0, -1, 2, 1, 0, 3], [3, 1, 5, 1, 1, 7]),  # four adapters and the base, mixed
        ([2, 2, 2], [1, 1, 1]),  # one adapter for every row: the whole-batch group
        ([-1, -1], [4, 2]),  # no adapter: nothing added
        ([1, -1, 1], [1, 1, 1]),  # decode rows, one adapter split by a base row
    ],
)
@pytest.mark.parametrize("outs", [(24, 8, 8), (40,)])  # a fused QKV's slices, one slice
def test_grouped_equals_reference(row_slots: list[int], counts: list[int], outs: tuple) -> None:
    k, rank, t = 32, 4, sum(counts)
    a, bs = _weights(4, rank, k, outs, seed=len(row_slots))
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(7))  # [T, K]
    mapping = LoRAMapping.from_rows(row_slots, counts, torch.device("cpu"))
    base = torch.randn(t, sum(outs))  # stands for the base linear's output
    out = base.clone()
    lora_delta_grouped(x, a, bs, mapping, out)
    ref = lora_delta_reference(x, a, bs, mapping.token_slots)
    torch.testing.assert_close(out - base, ref, rtol=1e-5, atol=1e-5)
    # rows of the base model are untouched, bit for bit
    base_rows = mapping.token_slots == -1
    assert torch.equal(out[base_rows], base[base_rows])


def test_reference_is_one_matmul_pair_per_row() -> None:
    """The reference itself, against a plain per-row computation."""
    a, bs = _weights(2, 3, 8, (5, 6), seed=1)
    x = torch.randn(3, 8)
    slots = torch.tensor([1, -1, 0])
    ref = lora_delta_reference(x, a, bs, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(ref[t], torch.zeros(11))
            continue
        h = a[s] @ x[t]  # [2*3]
        want = torch.cat([h[:3] @ bs[0][s], h[3:] @ bs[1][s]])
        torch.testing.assert_close(ref[t], want)


def test_mapping_groups_rows_by_slot() -> None:
    m = LoRAMapping.from_rows([1, -1, 0, 1], [2, 1, 1, 3], torch.device("cpu"))
    assert m.token_slots.tolist() == [1, 1, -1, 0, 1, 1, 1]
    groups = {slot: rows.tolist() for slot, rows in m.groups if rows is not None}
    assert groups == {0: [3], 1: [0, 1, 4, 5, 6]}
    whole = LoRAMapping.from_rows([0, 0], [2, 1], torch.device("cpu"))
    assert [(s, rows) for s, rows in whole.groups] == [(0, None)]


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


@needs_kernels
@pytest.mark.parametrize(
    ("row_slots", "counts"),
    [
        ([0, -1, 2, 1, 0, 3], [3, 1, 5, 1, 1, 7]),  # four adapters and the base, mixed
        ([1] * 11, [1] * 11),  # one adapter on 11 rows: row tiles of 4 and a tail
        ([0, -1, 1], [70, 3, 5]),  # a prefill of 70 rows: two row blocks of the shrink
        ([3, -1, 3, 0], [1, 1, 1, 1]),  # decode rows, one adapter split by a base row
        ([-1], [5]),  # no adapter: nothing touched
    ],
)
# a fused QKV (slices of 8-wide and odd widths), a wide MLP slice (64-channel blocks + tail)
@pytest.mark.parametrize(("k", "outs"), [(36, (24, 8, 13)), (64, (150,)), (21, (7, 5))])
def test_cpu_kernel_equals_reference_float32(
    row_slots: list[int], counts: list[int], k: int, outs: tuple[int, ...]
) -> None:
    rank, t = 16, sum(counts)
    a, bts = _weights(4, rank, k, outs, seed=k)
    x = torch.randn(t, k + 3, generator=torch.Generator().manual_seed(2))[:, :k]  # row stride
    mapping = LoRAMapping.from_rows(row_slots, counts, torch.device("cpu"))
    base = torch.randn(t, sum(outs))
    out = base.clone()
    cpu_kernels.lora_add(out, x, a, bts, mapping.token_slots)
    ref = lora_delta_reference(x.double(), a.double(), [b.double() for b in bts],
                               mapping.token_slots)  # fmt: skip
    torch.testing.assert_close((out - base).double(), ref, rtol=1e-5, atol=1e-4)
    base_rows = mapping.token_slots == -1
    assert torch.equal(out[base_rows], base[base_rows])


@needs_kernels
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernel_16bit(act_dtype: torch.dtype) -> None:
    """bf16 weights, bf16 or float32 activations: the float32 sums of the stored values, the
    out row rounded once."""
    row_slots, counts, k, outs = [2, 0, -1, 2], [3, 2, 2, 5], 40, (72, 9)
    a, bts = _weights(3, 8, k, outs, seed=4)
    a, bts = a.bfloat16(), tuple(b.bfloat16() for b in bts)
    x = torch.randn(sum(counts), k).to(act_dtype)
    mapping = LoRAMapping.from_rows(row_slots, counts, torch.device("cpu"))
    base = torch.randn(sum(counts), sum(outs)).to(act_dtype)
    out = base.clone()
    cpu_kernels.lora_add(out, x, a, bts, mapping.token_slots)
    ref = lora_delta_reference(x.double(), a.double(), [b.double() for b in bts],
                               mapping.token_slots)  # fmt: skip
    want = (base.double() + ref).to(act_dtype)  # the exact sum, rounded once
    if act_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding of a float32 sum: at most one ulp from the rounded exact sum
        assert ((out.double() - want.double()).abs() <= want.double().abs() / 128 + 1e-6).all()
    assert torch.equal(out[mapping.token_slots == -1], base[mapping.token_slots == -1])


@needs_kernels
def test_cpu_kernel_refuses_bad_slots() -> None:
    a, bts = _weights(2, 4, 8, (8,), seed=1)
    x, out = torch.randn(2, 8), torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match=r"slot 2 of row 1 is outside \[-1, 2\)"):
        cpu_kernels.lora_add(out, x, a, bts, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="every Bt must be"):
        strided = bts[0].transpose(1, 2).contiguous().transpose(1, 2)  # [S, R, N], not contiguous
        cpu_kernels.lora_add(out, x, a, [strided], torch.tensor([0, 1]))


@needs_kernels
def test_cpu_kernel_threaded_call() -> None:
    """A call above the kernel's inline threshold (2^18 multiply-adds: ~1.1M here) runs both
    phases in the thread team: the same delta as the reference."""
    k, rank, outs = 256, 16, (512, 96)
    a, bts = _weights(4, rank, k, outs, seed=3)
    mapping = LoRAMapping.from_rows([2, -1, 0, 3, 1], [30, 4, 3, 9, 1], torch.device("cpu"))
    t = int(mapping.token_slots.shape[0])
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(5))
    out = torch.zeros(t, sum(outs))
    cpu_kernels.lora_add(out, x, a, bts, mapping.token_slots)
    ref = lora_delta_reference(x.double(), a.double(), [b.double() for b in bts],
                               mapping.token_slots)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


def integer_case(seed: int) -> tuple:
    """bf16 inputs of small integers: every product and sum the kernel makes is exact in
    float32 (|delta| <= 16 * 240 * 2), so the only rounding left is the bf16 store of
    ``base + delta``, often a tie (sums of a few thousand hold 8 significant bits)."""
    g = torch.Generator().manual_seed(seed)
    t, k, rank, outs = 9, 40, 16, (70, 33)  # a 64-channel block plus tails, 16-wide tails
    x = torch.randint(-3, 4, (t, k), generator=g).bfloat16()
    a = torch.randint(-2, 3, (3, 2 * rank, k), generator=g).bfloat16()
    bts = [torch.randint(-2, 3, (3, rank, n), generator=g).bfloat16() for n in outs]
    slots = torch.tensor([0, 1, 2, -1, 0, 1, 2, 0, 1])
    base = torch.randint(-600, 600, (t, sum(outs)), generator=g).bfloat16()
    base[0, 5] = float("nan")
    return x, a, bts, slots, base


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_kernel_bf16_store_rounds_as_torch(seed: int) -> None:
    x, a, bts, slots, base = integer_case(seed)
    out = base.clone()
    cpu_kernels.lora_add(out, x, a, bts, slots)
    delta = lora_delta_reference(x.double(), a.double(), [b.double() for b in bts], slots)
    want = (base.float() + delta.float()).bfloat16()  # torch's round to nearest even
    assert torch.equal(torch.isnan(out), torch.isnan(want))  # NaN kept (its bits vary)
    keep = ~torch.isnan(want)
    assert torch.equal(out[keep].view(torch.int16), want[keep].view(torch.int16))
    rounded = ((base.float() + delta.float()) != want.float()) & keep
    assert int(rounded.sum()) > 50  # many sums are rounded, so a wrong rounding shows
