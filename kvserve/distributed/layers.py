"""Tensor-parallel linear and embedding layers (Megatron's split, as vLLM and nano-vllm do it).

A decoder layer communicates twice: the column-parallel QKV and gate/up projections give each
rank a slice of the heads / of the intermediate features with no communication, attention and
SiLU*up run on that slice, and the row-parallel o_proj and down_proj each produce a partial
sum that one all-reduce completes. The embedding and the LM head split the vocabulary.

Each layer is an ``nn.Linear`` (``nn.Embedding``) whose weight is this rank's shard, so what
works on a plain layer works on it: oneDNN prepacking (``packed()`` keeps the communication,
``packed_linear.pack_linears`` calls it), the C++ fused ops (which see one rank's head counts),
and, at ``world_size`` 1, everything else. At ``world_size`` 1 each layer runs exactly the op
of the plain layer it replaces (bit-identical outputs).

Weights load from the full checkpoint tensors: each layer's ``weight_loader(param, full,
shard)`` copies this rank's slice into ``param`` (for a fused layer, into the slot of
checkpoint tensor ``shard``), so no rank ever holds another rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import (
    SINGLE,
    TPGroup,
    all_reduce,
    divide,
    gather_to_driver,
)
from kvserve.ops.packed_linear import DEFAULT_BATCH_HINT, PackedLinear


@torch.no_grad()
def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a replicated (unsharded) tensor, refusing a shape that is not the parameter's."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter "
                         f"of shape {tuple(param.shape)}")  # fmt: skip
    param.copy_(loaded)


def _check_full(loaded: torch.Tensor, dim: int, size: int, what: str) -> None:
    if loaded.shape[dim] != size:
        raise ValueError(f"{what}: checkpoint tensor of shape {tuple(loaded.shape)}, "
                         f"expected {size} along dim {dim}")  # fmt: skip


def heads_per_rank(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """Query and K/V heads of one rank. Heads are never split or replicated across ranks,
    so both counts must divide by the world size (else a ``ValueError``)."""
    check_heads(num_heads, num_kv_heads, tp.world_size)
    return num_heads // tp.world_size, num_kv_heads // tp.world_size


def check_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """``heads_per_rank``'s check without a group: the driver runs it before any rank loads."""
    if num_heads % world_size or num_kv_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} must divide num_attention_heads "
            f"({num_heads}) and num_key_value_heads ({num_kv_heads})"
        )


class ColumnParallelLinear(nn.Linear):
    """``y_r = x W_r^T + b_r``: output features split across ranks; ``y`` stays sharded
    (``[T, out / world_size]``), for a layer that consumes this rank's slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        super().__init__(in_features, divide(out_features, tp, "output features"), bias=bias)
        self.tp = tp
        self.full_out_features = out_features

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        """``loaded``: the full ``[out, in]`` weight or ``[out]`` bias."""
        _check_full(loaded, 0, self.full_out_features, "column-parallel linear")
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * n, n))

    def packed(self, batch_hint: int = DEFAULT_BATCH_HINT) -> nn.Module:
        """The prepacked layer (no communication to keep)."""
        return PackedLinear(self, batch_hint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.tp.rank}/{self.tp.world_size}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate/up).

    This rank's weight is its slice of each part, in order: ``[gate_r; up_r]``, so the
    rank's output splits into its parts exactly as the unsharded output does.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup = SINGLE
    ) -> None:
        self.output_sizes = list(output_sizes)  # full checkpoint sizes, one per part
        self.local_sizes = [divide(s, tp, "output features") for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        """``loaded``: part ``shard``'s full weight (or bias), e.g. ``up_proj.weight``."""
        if shard is None or not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"merged linear needs a part index in [0, {len(self.output_sizes)})")
        _check_full(loaded, 0, self.output_sizes[shard], f"part {shard} of a merged linear")
        n = self.local_sizes[shard]
        dst = param.narrow(0, sum(self.local_sizes[:shard]), n)
        default_weight_loader(dst, loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused Q/K/V projection: this rank computes its ``num_heads`` query heads and
    ``num_kv_heads`` K/V heads, laid out ``[q_r; k_r; v_r]`` (what the attention layer and
    the fused RoPE + KV-write kernel split)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.num_heads, self.num_kv_heads = heads_per_rank(num_heads, num_kv_heads, tp)
        kv = num_kv_heads * head_dim
        super().__init__(hidden, [num_heads * head_dim, kv, kv], bias, tp)


class RowParallelLinear(nn.Linear):
    """``y = sum_r x_r W_r^T + b``: input features split across ranks (``x`` is this rank's
    slice, the output of a column-parallel layer); one all-reduce sums the partial products
    and the bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        super().__init__(divide(in_features, tp, "input features"), out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)  # the plain layer's single op
        return self.finish(self.partial_product(x))

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``x_r W_r^T`` (``[T, out]``, no bias)."""
        return F.linear(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums added (the all-reduce, in place), then the bias."""
        y = all_reduce(y, self.tp)  # [T, out]
        return y if self.bias is None else y + self.bias

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        """``loaded``: the full ``[out, in]`` weight (split along ``in``) or the ``[out]``
        bias (replicated)."""
        if loaded.dim() == 1:
            default_weight_loader(param, loaded)
            return
        _check_full(loaded, 1, self.full_in_features, "row-parallel linear")
        n = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * n, n))

    def packed(self, batch_hint: int = DEFAULT_BATCH_HINT) -> nn.Module:
        if self.tp.world_size == 1:
            return PackedLinear(self, batch_hint)
        return PackedRowParallelLinear(self, batch_hint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.tp.rank}/{self.tp.world_size}"


class RowParallelShard(nn.Module):
    """A row-parallel shard whose product another layer computes (a ``QuantLinear`` of this
    rank's slice of the input features, built without the bias): one all-reduce sums the
    partial products, and the bias is added once, after it, as ``RowParallelLinear`` does."""

    def __init__(self, inner: nn.Module, tp: TPGroup, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial_product(x))

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # [T, out]

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = all_reduce(y, self.tp)  # [T, out]
        return y if self.bias is None else y + self.bias


class PackedRowParallelLinear(PackedLinear):
    """A prepacked row-parallel shard that keeps its all-reduce and adds the bias after it."""

    def __init__(self, layer: RowParallelLinear, batch_hint: int = DEFAULT_BATCH_HINT) -> None:
        super().__init__(layer, batch_hint)
        self.tp = layer.tp
        self.out_bias, self.bias = self.bias, None  # the packed matmul runs without it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial_product(x))

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # [T, out]

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = all_reduce(y, self.tp)
        return y if self.out_bias is None else y + self.out_bias


class RowParallel(Protocol):
    """A row-parallel layer split at its all-reduce: ``forward(x) == finish(partial_product(x))``
    at ``world_size`` > 1 (``RowParallelLinear``, its packed form, ``RowParallelShard``)."""

    tp: TPGroup

    def partial_product(self, x: torch.Tensor) -> torch.Tensor: ...

    def finish(self, y: torch.Tensor) -> torch.Tensor: ...


def row_parallel_with(
    layer: nn.Module, x: torch.Tensor, add: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``layer(x)`` with ``add`` applied to this rank's partial sum before the all-reduce
    (a LoRA delta of this rank's input slice: the all-reduce sums the ranks' parts of it as
    it sums the base layer's, so it costs no extra communication, as in vLLM). One rank (or
    a layer that is not row-parallel): ``add(layer(x))``."""
    if getattr(getattr(layer, "tp", None), "world_size", 1) == 1:
        return add(layer(x))
    if not hasattr(layer, "partial_product"):
        raise TypeError(f"{type(layer).__name__} is not a row-parallel layer with a "
                        "partial product (RowParallelLinear, RowParallelShard)")  # fmt: skip
    row: RowParallel = layer  # type: ignore[assignment]
    return row.finish(add(row.partial_product(x)))


class _VocabShard:
    """Rows ``[start, start + size)`` of the vocabulary belong to this rank. Each rank holds
    ``ceil(vocab / world_size)`` rows; rows past the vocabulary (the last rank's padding)
    are zero and their logits are cut off after the gather."""

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.rows
        self.valid = max(0, min(self.rows, vocab_size - self.start))  # rows before padding

    @torch.no_grad()
    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        _check_full(loaded, 0, self.vocab_size, "vocabulary-parallel weight")
        start = min(self.start, self.vocab_size)  # past the vocabulary: all padding
        default_weight_loader(param[: self.valid], loaded.narrow(0, start, self.valid))
        param[self.valid :].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Each rank embeds the token ids of its vocabulary slice (zeros for the others); one
    all-reduce adds the ranks' rows, exactly one of which is non-zero per token."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        self.shard = _VocabShard(vocab_size, tp)
        super().__init__(self.shard.rows, hidden)
        self.tp = tp

    def reset_parameters(self) -> None:
        # A model built on the meta device (``loader._load_native``) has nothing to fill, and
        # ``normal_`` on a meta tensor runs torch's Python reference, whose first call
        # imports torch._dynamo (and sympy, triton): ~1.5 s of CPU in every model load.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(ids)
        start = self.shard.start
        mine = (ids >= start) & (ids < start + self.shard.valid)  # [T]
        local = torch.where(mine, ids - start, 0)
        y = F.embedding(local, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)  # [T, hidden]
        return all_reduce(y, self.tp)

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        self.shard.load(param, loaded)


class ParallelLMHead(nn.Linear):
    """Each rank computes the logits of its vocabulary slice; they are gathered on rank 0,
    which alone samples: the forward returns ``[N, vocab]`` there and ``None`` on the other
    ranks. Every rank must call it with the same rows (it is a collective)."""

    def __init__(self, hidden: int, vocab_size: int, tp: TPGroup = SINGLE) -> None:
        self.shard = _VocabShard(vocab_size, tp)
        super().__init__(hidden, self.shard.rows, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return gather_vocab(super().forward(x), self.shard, self.tp)

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        self.shard.load(param, loaded)

    def packed(self, batch_hint: int = DEFAULT_BATCH_HINT) -> nn.Module:
        if self.tp.world_size == 1:
            return PackedLinear(self, batch_hint)
        return PackedParallelLMHead(self, batch_hint)


class PackedParallelLMHead(PackedLinear):
    """A prepacked LM head shard that still gathers the logits on rank 0."""

    def __init__(self, layer: ParallelLMHead, batch_hint: int = DEFAULT_BATCH_HINT) -> None:
        super().__init__(layer, batch_hint)
        self.shard = layer.shard
        self.tp = layer.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return gather_vocab(super().forward(x), self.shard, self.tp)


def gather_vocab(local: torch.Tensor, shard: _VocabShard, tp: TPGroup) -> torch.Tensor | None:
    """``[N, rows]`` logits of each rank -> ``[N, vocab]`` on rank 0 (padding cut off)."""
    full = gather_to_driver(local, tp)  # [N, world_size * rows] on rank 0
    if full is None or full.shape[-1] == shard.vocab_size:
        return full
    return full[:, : shard.vocab_size].contiguous()


def load_weight(
    model: nn.Module,
    name: str,
    param: torch.Tensor,
    loaded: torch.Tensor,
    shard: int | None = None,
) -> None:
    """Load the full checkpoint tensor ``loaded`` into parameter ``name`` of ``model``
    through its layer's ``weight_loader`` (this rank's slice; part ``shard`` of a fused
    layer), or copy it whole into a layer that is not sharded (norms)."""
    owner_name, _, _ = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    loader = getattr(owner, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, shard)
    elif shard is not None:
        raise ValueError(f"{name}: {type(owner).__name__} is not a fused layer")
    else:
        default_weight_loader(param, loaded)
