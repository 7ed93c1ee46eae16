"""The per-row LoRA delta of a mixed batch (punica's idea, in PyTorch).

A step's token rows each run one adapter (a device slot) or none (slot -1). A linear layer
with adapters computes ``y = base(x) + x @ A[s]^T @ B[s]^T`` for each row's slot ``s``,
never merging weights and never looping over requests:

- ``lora_delta_grouped`` (the fast path): rows grouped by slot once per step
  (``LoRAMapping``), then per active slot one "shrink" matmul ``[n, K] x [K, S*R]`` for all
  slices of a fused layer and one "expand" matmul per slice, scattered back with
  ``index_add_``: at most ``max_loras`` groups, whatever the number of requests (punica's
  SGMV: segments of rows sharing an adapter).
- ``lora_delta_reference``: every row gathers its own A and B (punica's BGMV as batched
  einsums); memory ``T * S*R * K``, so the tests' reference only.

B is stored transposed, ``Bt [S, R, N_i]`` per slice: the expand is then an axpy over
contiguous output channels in the C++ kernel (``csrc/lora_ops.cpp``, one call per linear),
which ``LoRAKernel`` picks on a CPU with the kernels built; the grouped PyTorch path is the
fallback and the reference's neighbour.

A slot's rank is padded with zeros to ``max_lora_rank``, so adapters of any rank share the
stacked tensors; the scaling is folded into B when an adapter enters its slot.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """Which device slot each token row of a step uses; built once per step by the runner
    (``LoRAManager.prepare``) and read by every LoRA layer."""

    token_slots: torch.Tensor  # [T] int64, each row's slot (-1: the base model only)
    # per active slot: (slot, row indices [n] int64), or None when the slot has every row
    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def from_rows(
        cls, slots: Sequence[int], counts: Sequence[int], device: torch.device
    ) -> LoRAMapping:
        """Each request's slot and token count, in batch order (-1: no adapter)."""
        token_slots = torch.repeat_interleave(
            torch.tensor(list(slots), dtype=torch.long), torch.tensor(list(counts))
        )  # [T]
        total = int(token_slots.shape[0])
        groups = []
        for slot in sorted(set(slots) - {-1}):
            rows = torch.nonzero(token_slots == slot).flatten()  # [n]
            groups.append((slot, None if rows.shape[0] == total else rows.to(device)))
        return cls(token_slots.to(device), tuple(groups))


def lora_delta_grouped(
    x: torch.Tensor,
    a: torch.Tensor,
    bts: Sequence[torch.Tensor],
    mapping: LoRAMapping,
    out: torch.Tensor,
) -> None:
    """``out[t, slice i] += (x[t] @ A[s_t]^T)[slice i's rank block] @ Bt_i[s_t]`` in place.

    ``x``: [T, K]; ``a``: [S, n*R, K], the slices' A stacked along the rank; ``bts``: n
    tensors [S, R, N_i] (B transposed); ``out``: [T, sum N_i], the base layer's output."""
    r = bts[0].shape[1]
    for slot, rows in mapping.groups:
        xs = x if rows is None else x.index_select(0, rows)  # [n, K]
        h = xs @ a[slot].t()  # [n, S*R]
        parts = [h[:, i * r : (i + 1) * r] @ bt[slot] for i, bt in enumerate(bts)]  # [n, N_i]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [n, sum N_i]
        if rows is None:
            out += delta
        else:
            out.index_add_(0, rows, delta)


def lora_delta_reference(
    x: torch.Tensor, a: torch.Tensor, bts: Sequence[torch.Tensor], token_slots: torch.Tensor
) -> torch.Tensor:
    """The delta ``[T, sum N_i]`` with each row gathering its own slot's A and Bt."""
    r = bts[0].shape[1]
    use = (token_slots >= 0).to(x.dtype)[:, None]  # [T, 1]
    safe = token_slots.clamp(min=0)
    h = torch.einsum("tk,trk->tr", x, a[safe])  # [T, S*R]
    parts = [
        torch.einsum("tr,trn->tn", h[:, i * r : (i + 1) * r], bt[safe]) for i, bt in enumerate(bts)
    ]  # [T, N_i]
    return torch.cat(parts, dim=1) * use


class LoRAKernel(enum.Enum):
    """Which implementation adds a linear's LoRA delta (``select_kernel``)."""

    CPU = "cpu"  # csrc/lora_ops.cpp: one call per linear
    TRITON = "triton"  # kvserve/ops/triton/lora.py: shrink + expand launches per linear
    TORCH = "torch"  # lora_delta_grouped: ~6 ops per active slot per linear


def select_kernel(device: torch.device) -> LoRAKernel:
    """The C++ kernel on a CPU where it is built, Triton on CUDA where Triton imports, else
    the grouped PyTorch path."""
    if device.type == "cpu":
        from kvserve.ops import cpu_kernels

        return LoRAKernel.CPU if cpu_kernels.available() else LoRAKernel.TORCH
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return LoRAKernel.TORCH
        return LoRAKernel.TRITON
    return LoRAKernel.TORCH


def lora_add(
    kernel: LoRAKernel,
    x: torch.Tensor,
    a: torch.Tensor,
    bts: Sequence[torch.Tensor],
    mapping: LoRAMapping,
    out: torch.Tensor,
) -> None:
    """``lora_delta_grouped``'s contract through ``kernel``."""
    if kernel is LoRAKernel.CPU:
        from kvserve.ops import cpu_kernels

        cpu_kernels.lora_add(out, x, a, bts, mapping.token_slots)
    elif kernel is LoRAKernel.TRITON:
        from kvserve.ops.triton import lora as triton_lora

        triton_lora.lora_add(out, x, a, bts, mapping.token_slots)
    else:
        lora_delta_grouped(x, a, bts, mapping, out)
