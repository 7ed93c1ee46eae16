"""One tensor-parallel rank's slice of a LoRA adapter (vLLM's split, ``vllm/lora/layers``).

The delta of a linear is ``x @ A^T @ B^T`` (A ``[r, in]``, B ``[out, r]``). Each rank keeps
the part that matches its shard of the base layer, and the rank ``r`` is never split:

- column-parallel layers (q/k/v, gate/up: output features split) keep A whole and the rows
  of B for their output features (each part of a fused layer sliced on its own, as the base
  weight is), so the delta lands on the rank's own output columns with no communication;
- row-parallel layers (o_proj, down_proj: input features split) keep the columns of A for
  their input slice and B whole; ``x_r @ A_r^T @ B^T`` is a partial sum that the layer's own
  all-reduce completes (``distributed.layers.row_parallel_with``), since
  ``sum_r x_r A_r^T = x A^T``.

An adapter is checked against the whole model first (``peft_loader``), then sliced here, so
its host copy on each rank is the slice only.
"""

from __future__ import annotations

import enum

import torch

from kvserve.lora.peft_loader import LoRAAdapterError, LoRAModel


class LoRASplit(enum.Enum):
    """How a module's base layer is split across ranks."""

    COLUMN = "column"  # output features: slice B's rows
    ROW = "row"  # input features: slice A's columns


SPLIT = {
    "q_proj": LoRASplit.COLUMN, "k_proj": LoRASplit.COLUMN, "v_proj": LoRASplit.COLUMN,
    "gate_proj": LoRASplit.COLUMN, "up_proj": LoRASplit.COLUMN,
    "o_proj": LoRASplit.ROW, "down_proj": LoRASplit.ROW,
}  # fmt: skip


def shard_pair(
    module: str, a: torch.Tensor, b: torch.Tensor, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s A ``[r, in']`` and B ``[out', r]`` of ``module``'s whole A ``[r, in]``
    and B ``[out, r]`` (copies: the whole tensors can be freed)."""
    split = SPLIT[module]
    dim, t = (0, b) if split is LoRASplit.COLUMN else (1, a)
    size = t.shape[dim]
    if size % world_size:
        raise LoRAAdapterError(
            f"{module}: {size} {'output' if dim == 0 else 'input'} features do not split "
            f"over tensor_parallel_size {world_size}"
        )
    n = size // world_size
    part = t.narrow(dim, rank * n, n).contiguous()
    return (a.contiguous(), part) if split is LoRASplit.COLUMN else (part, b.contiguous())


def shard_lora_model(model: LoRAModel, rank: int, world_size: int) -> LoRAModel:
    """``model`` as rank ``rank`` of ``world_size`` holds it; the model itself at one rank."""
    if world_size == 1:
        return model
    weights = {
        key: shard_pair(key[1], a, b, rank, world_size) for key, (a, b) in model.weights.items()
    }
    return LoRAModel(model.lora_int_id, model.rank, model.scaling, weights)
