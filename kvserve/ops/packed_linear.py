"""oneDNN-prepacked linear layers: the CPU fast path behind ``nn.Linear``'s interface.

``F.linear`` on a CPU bf16 tensor goes through oneDNN, which reorders the weight into its
blocked (AMX/AVX-512) layout on every call. Reordering once at load time, as inductor does
with ``freezing``, removes that per-call cost. The reference stays ``nn.Linear``; tests check
the packed layer gives the same numbers (bf16: bit-identical at decode sizes).

float32 (what ``dtype=auto`` picks on AVX2-only CPUs, whose oneDNN has no bf16 kernels) packs
only the layers where oneDNN's packed kernel wins at every decode batch size, measured on the
built-in model's shapes (AMD EPYC, 2 cores, AVX2): the LM head (49152 x 576: 7.5 -> 3.7 ms
at 1 row, 17.2 -> 6.3 ms at 8, 26 -> 14.6 ms at 32) and the fused gate/up projection
(190 -> 144 us at 1 row, 461 -> 238 at 8, 961 -> 776 at 32). QKV, o and down were slower packed
at 1 row (e.g. down 75 -> 91 us). Packed float32 sums in another order than ``F.linear``:
results differ by ~1e-4 relative (tested within tolerance, not bit for bit).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# The batch-size hint oneDNN picks its kernel for. With a hint of 64 the packed kernel gives
# bit-identical results to F.linear at decode batch sizes (tested up to 300 rows), unlike small
# hints; at thousands of rows (large prefills) the two may pick different blockings.
DEFAULT_BATCH_HINT = 64


# The layers float32 packs (see the module docstring for the measurements).
FLOAT32_PACKED = ("lm_head", "gate_up_proj")


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking applies to bf16 on CPUs whose oneDNN has a bf16 path for them, and to
    float32 (some layers, ``FLOAT32_PACKED``) wherever oneDNN runs."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return _onednn_packing()
    return dtype == torch.bfloat16 and _onednn_bf16_packing()


def _onednn_packing() -> bool:
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


@functools.cache
def _onednn_bf16_packing() -> bool:
    """Whether this CPU can run oneDNN's bf16 weight reorder.

    oneDNN's bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (seen
    on an AMD EPYC Milan VM) ``_reorder_linear_weight`` raises, so the server could not even
    load its model. Asked once, with a tiny probe; such CPUs keep ``nn.Linear``.
    """
    mkldnn = torch.ops.mkldnn
    if not _onednn_packing():
        return False
    if hasattr(mkldnn, "_is_mkldnn_bf16_supported") and not mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


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


def pack_linears(
    model: nn.Module,
    batch_hint: int = DEFAULT_BATCH_HINT,
    only: tuple[str, ...] | None = None,
) -> int:
    """Replace every ``nn.Linear`` in ``model`` (or only those whose attribute name is in
    ``only``) by a ``PackedLinear``; returns how many.

    A tied lm_head gets its own packed copy; the embedding keeps the original weight. A layer
    with a ``packed(batch_hint)`` method (``kvserve.distributed.layers``) builds its own.
    """
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if only is None or name in only:
                # A tensor-parallel layer packs its own way (keeping its all-reduce/gather).
                packed = getattr(child, "packed", None)
                setattr(
                    model, name, packed(batch_hint) if packed else PackedLinear(child, batch_hint)
                )
                count += 1
        else:
            count += pack_linears(child, batch_hint, only)
    return count
