"""The grouped per-row LoRA delta against the gathered reference (float32, exact shapes)."""

from __future__ import annotations

import pytest
import torch

from kvserve.lora.punica import LoRAMapping, lora_delta_grouped, lora_delta_reference


def _weights(
    slots: int, rank: int, k: int, outs: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, len(outs) * rank, k, generator=g)  # [S, n*R, K]
    bs = tuple(torch.randn(slots, n, rank, generator=g) for n in outs)  # [S, N_i, R]
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
        want = torch.cat([bs[0][s] @ h[:3], bs[1][s] @ h[3:]])
        torch.testing.assert_close(ref[t], want)


def test_mapping_groups_rows_by_slot() -> None:
    m = LoRAMapping.from_rows([1, -1, 0, 1], [2, 1, 1, 3], torch.device("cpu"))
    assert m.token_slots.tolist() == [1, 1, -1, 0, 1, 1, 1]
    groups = {slot: rows.tolist() for slot, rows in m.groups if rows is not None}
    assert groups == {0: [3], 1: [0, 1, 4, 5, 6]}
    whole = LoRAMapping.from_rows([0, 0], [2, 1], torch.device("cpu"))
    assert [(s, rows) for s, rows in whole.groups] == [(0, None)]
