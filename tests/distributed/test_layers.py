"""Each tensor-parallel layer, on 2 real gloo ranks, against the plain layer it shards.

Every rank builds the same plain ``nn.Linear`` / ``nn.Embedding`` (same seed), loads the
parallel layer from its full weights through the layer's weight loader, and checks its own
output (a slice, or the all-reduced whole) against the plain layer's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.distributed.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    PackedParallelLMHead,
    PackedRowParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    heads_per_rank,
)
from kvserve.distributed.parallel_state import (
    SINGLE,
    TPGroup,
    all_gather,
    all_reduce,
    divide,
    gather_to_driver,
)
from kvserve.ops.packed_linear import PackedLinear, pack_linears, packing_supported
from tests.distributed.utils import run_ranks

ATOL = 1e-5


def _plain(n_in: int, n_out: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias)


def _x(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(7))


def check_collectives(tp: TPGroup) -> None:
    x = torch.full((2, 3), float(tp.rank + 1))
    assert torch.equal(all_reduce(x.clone(), tp), torch.full((2, 3), 3.0))
    gathered = all_gather(x, tp)  # [2, 6]: rank 0's columns, then rank 1's
    assert torch.equal(gathered, torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)], -1))
    on_driver = gather_to_driver(x, tp)
    if tp.rank == 0:
        assert on_driver is not None and torch.equal(on_driver, gathered)
    else:
        assert on_driver is None


def check_linears(tp: TPGroup) -> None:
    r, w = tp.rank, tp.world_size
    x = _x(5, 16)  # [T, in]
    # Column-parallel (with bias): this rank's slice of the outputs.
    ref = _plain(16, 12, True, 0)
    col = ColumnParallelLinear(16, 12, True, tp)
    col.weight_loader(col.weight, ref.weight.detach())
    col.weight_loader(col.bias, ref.bias.detach())
    want = ref(x).chunk(w, -1)[r]
    torch.testing.assert_close(col(x), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(all_gather(col(x), tp), ref(x), atol=ATOL, rtol=0)
    # Merged gate/up: [gate_r, up_r].
    gate, up = _plain(16, 8, False, 1), _plain(16, 8, False, 2)
    merged = MergedColumnParallelLinear(16, [8, 8], False, tp)
    merged.weight_loader(merged.weight, up.weight.detach(), 1)  # any order
    merged.weight_loader(merged.weight, gate.weight.detach(), 0)
    g, u = merged(x).split(8 // w, -1)
    torch.testing.assert_close(g, gate(x).chunk(w, -1)[r], atol=ATOL, rtol=0)
    torch.testing.assert_close(u, up(x).chunk(w, -1)[r], atol=ATOL, rtol=0)
    # QKV with 4 query heads and 2 K/V heads of dim 3, with bias: parts of unequal size.
    q, k, v = (_plain(16, n, True, s) for n, s in ((12, 3), (6, 4), (6, 5)))
    qkv = QKVParallelLinear(16, 3, 4, 2, True, tp)
    assert (qkv.num_heads, qkv.num_kv_heads) == (4 // w, 2 // w)
    for i, part in enumerate((q, k, v)):
        qkv.weight_loader(qkv.weight, part.weight.detach(), i)
        qkv.weight_loader(qkv.bias, part.bias.detach(), i)
    got = qkv(x).split([12 // w, 6 // w, 6 // w], -1)
    for g_part, part in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(g_part, part(x).chunk(w, -1)[r], atol=ATOL, rtol=0)
    # Row-parallel (with bias): this rank's input slice in, the whole output out, bias once.
    ref = _plain(16, 10, True, 6)
    row = RowParallelLinear(16, 10, True, tp)
    row.weight_loader(row.weight, ref.weight.detach())
    row.weight_loader(row.bias, ref.bias.detach())
    torch.testing.assert_close(row(x.chunk(w, -1)[r]), ref(x), atol=ATOL, rtol=0)
    # A checkpoint tensor of the wrong shape is refused, not silently sliced.
    with pytest.raises(ValueError, match="expected 16 along dim 1"):
        row.weight_loader(row.weight, torch.zeros(10, 12))


def check_vocab(tp: TPGroup) -> None:
    vocab, hidden = 11, 6  # 11 rows over 2 ranks: 6 each, the last rank's 6th is padding
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, hidden)
    emb = VocabParallelEmbedding(vocab, hidden, tp)
    assert emb.weight.shape == (6, hidden)
    emb.weight_loader(emb.weight, ref.weight.detach())
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])  # both ranks' slices, repeats
    assert torch.equal(emb(ids), ref(ids))  # one non-zero term per token: exact
    head = ParallelLMHead(hidden, vocab, tp)
    head.weight_loader(head.weight, ref.weight.detach())
    h = _x(4, hidden)
    logits = head(h)
    if tp.is_driver:
        assert logits is not None and logits.shape == (4, vocab)
        torch.testing.assert_close(logits, h @ ref.weight.detach().T, atol=ATOL, rtol=0)
    else:
        assert logits is None


def check_packed(tp: TPGroup, dtype: torch.dtype) -> None:
    """Prepacked shards keep their communication: row-parallel all-reduces (bias once), the
    LM head gathers on rank 0."""
    r, w = tp.rank, tp.world_size
    model = nn.Module()
    model.o_proj = RowParallelLinear(16, 10, True, tp)
    model.lm_head = ParallelLMHead(16, 12, tp)
    ref, head_ref = _plain(16, 10, True, 0).to(dtype), _plain(16, 12, False, 1).to(dtype)
    with torch.no_grad():
        model.o_proj.weight_loader(model.o_proj.weight, ref.weight.detach())
        model.o_proj.weight_loader(model.o_proj.bias, ref.bias.detach())
        model.lm_head.weight_loader(model.lm_head.weight, head_ref.weight.detach())
    model.to(dtype)
    x = _x(3, 16).to(dtype)
    with torch.no_grad():
        before = model.o_proj(x.chunk(w, -1)[r]), model.lm_head(x)
        assert pack_linears(model) == 2
        assert isinstance(model.o_proj, PackedRowParallelLinear)
        assert isinstance(model.lm_head, PackedParallelLMHead)
        after = model.o_proj(x.chunk(w, -1)[r]), model.lm_head(x)
    # bf16 packed is bit-identical to F.linear at these sizes; float32 sums in another order.
    tol = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(after[0], before[0], **tol)
    if tp.is_driver:
        torch.testing.assert_close(after[1], before[1], **tol)
    else:
        assert after[1] is None and before[1] is None


def check_all_layers(tp: TPGroup) -> None:
    check_collectives(tp)
    check_linears(tp)
    check_vocab(tp)


def check_packed_dtypes(tp: TPGroup, dtypes: list[torch.dtype]) -> None:
    for dtype in dtypes:
        check_packed(tp, dtype)


# One spawn per test: starting a rank (importing kvserve) costs several seconds here.
def test_parallel_layers_match_plain_layers() -> None:
    run_ranks(check_all_layers, 2)


def test_packed_layers_keep_communication() -> None:
    dtypes = [
        d for d in (torch.float32, torch.bfloat16) if packing_supported(torch.device("cpu"), d)
    ]
    if not dtypes:
        pytest.skip("no oneDNN packing on this CPU")
    run_ranks(check_packed_dtypes, 2, dtypes)


def test_world_size_one_is_the_plain_layer() -> None:
    """At world_size 1 the layers are the plain ones, bit for bit, and pack as plain ones."""
    x = _x(5, 16)
    ref = _plain(16, 12, True, 0)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(16, 12, True)
        layer.weight_loader(layer.weight, ref.weight.detach())
        layer.weight_loader(layer.bias, ref.bias.detach())
        assert torch.equal(layer(x), ref(x))
        assert type(layer.packed()) is PackedLinear
    head = ParallelLMHead(16, 12)
    head.weight_loader(head.weight, ref.weight.detach())
    assert torch.equal(head(x), x @ ref.weight.detach().T)
    emb = VocabParallelEmbedding(12, 16)
    emb.weight_loader(emb.weight, ref.weight.detach())
    ids = torch.tensor([0, 11, 4])
    assert torch.equal(emb(ids), ref.weight.detach()[ids])
    with pytest.raises(ValueError, match=r"shape \(12, 15\) for a parameter of shape"):
        head.weight_loader(head.weight, torch.zeros(12, 15))
    y = torch.ones(3)
    assert all_reduce(y, SINGLE) is y and all_gather(y, SINGLE) is y
    assert gather_to_driver(y, SINGLE) is y


def test_tp_group_validation() -> None:
    assert SINGLE.is_driver and SINGLE.world_size == 1
    with pytest.raises(ValueError, match="outside"):
        TPGroup(rank=2, world_size=2, group=None)
    with pytest.raises(ValueError, match="needs a process group"):
        TPGroup(rank=0, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        TPGroup(rank=0, world_size=0)
    with pytest.raises(ValueError, match="must be an int"):
        TPGroup(rank=True, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"intermediate_size \(10\) is not divisible"):
        divide(10, TPGroup(0, 4, group=object()), "intermediate_size")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must divide num_attention_heads \(9\) and "
                       r"num_key_value_heads \(3\)"):  # fmt: skip
        heads_per_rank(9, 3, TPGroup(0, 2, group=object()))  # type: ignore[arg-type]
