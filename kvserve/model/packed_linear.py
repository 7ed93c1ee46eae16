"""oneDNN-prepacked linear layers: the CPU bf16 fast path behind ``nn.Linear``'s interface.

``F.linear`` on a CPU bf16 tensor goes through oneDNN, which reorders the weight into its
blocked (AMX/AVX-512) layout on every call. Reordering once at load time, as inductor does
with ``freezing``, removes that per-call cost. The reference stays ``nn.Linear``; tests check
the packed layer gives the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

# The batch-size hint oneDNN picks its kernel for. With a hint of 64 the packed kernel gives
# bit-identical results to F.linear at decode batch sizes (tested up to 300 rows), unlike small
# hints; at thousands of rows (large prefills) the two may pick different blockings.
DEFAULT_BATCH_HINT = 64


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking applies to bf16 on CPUs whose PyTorch build has oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W kept in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        # Packed weights are opaque to everything else: keep them out of state_dict/params.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], ""
        )
        return y.view(*shape[:-1], self.out_features)


def pack_linears(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many.

    A tied lm_head gets its own packed copy; the embedding keeps the original weight.
    """
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, batch_hint))
            count += 1
        else:
            count += pack_linears(child, batch_hint)
    return count
