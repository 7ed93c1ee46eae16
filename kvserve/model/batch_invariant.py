"""Batch-invariant mode's model side (``--batch-invariant``, docs/server.md): every linear
layer of a loaded model computes each row in a fixed order (``ops/batch_invariant.py``).

The loader runs such a model without oneDNN prepacking and without the C++ decode loop (both
call oneDNN/MKL GEMMs whose summation order depends on the number of rows); afterwards
``make_batch_invariant`` swaps every plain linear for a ``BatchInvariantLinear`` over the same
weight tensor (a tied LM head stays tied), lets widened layers (``WideLinear``) take every
row through their kernel instead of a float32 GEMM above 256 rows, and quantized layers
(``QuantLinear``) every row through their direct kernel path instead of the tiled one. The
other per-token ops are row-wise already: embeddings, RoPE, the fused RMSNorm / SiLU*up
kernels (one row's reduction in one thread, in a fixed order), and attention runs every query
through the C++ decode kernel (the runner marks every row a per-query row,
``worker/model_runner.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model.wide_linear import _PLAIN, WideLinear
from kvserve.ops.batch_invariant import invariant_linear
from kvserve.quantization.qlinear import QuantLinear

UNLIMITED_ROWS = 2**62  # a quantized layer's direct_rows that no batch reaches


class BatchInvariantLinear(nn.Module):
    """``y = x @ W^T + b`` with each row summed in a fixed order (``invariant_linear``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: a tied LM head stays tied  [N, K]
        self.bias = linear.bias  # [N] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def batch_invariant_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot run batch-invariant, or None. Only classes that say so
    (``supports_batch_invariant``: the dense native Llama family and Gemma) qualify: an MoE
    block multiplies the rows routed to each expert together, and the transformers backend's
    modules are not kvserve's."""
    if getattr(model, "supports_batch_invariant", False):
        return None
    return (f"{type(model).__name__} does not support it (the dense native classes do: Llama, "
            "Qwen2, Qwen3, Mistral, Gemma; not mixture-of-experts models or the transformers "
            "backend)")  # fmt: skip


def _fix_quantized(name: str, layer: QuantLinear) -> None:
    """Quantized layers: the direct kernel path for every row count (float32 / bf16
    activations; the tiled path above 4 rows sums in another order: measured, a row changed
    with its batch), or the int8-activation kernel as it is (rows four at a time, each in
    the same order; exact int32 block sums). The dequantizing reference path has none."""
    if layer.path == "kernel":
        layer.direct_rows = UNLIMITED_ROWS
    elif layer.path != "a8":
        raise ValueError(f"batch-invariant mode has no fixed-order path for {name}: "
                         "its quantized layer has no kernel here (it dequantizes per "
                         "call)")  # fmt: skip


def make_batch_invariant(model: nn.Module) -> int:
    """Swap every plain linear of ``model`` for a ``BatchInvariantLinear`` and give widened
    layers no row limit; returns how many layers changed, and marks the model
    (``batch_invariant``, read back by ``worker/execution_paths.py``). A ValueError names a
    layer kind that has no fixed-order path (prepacked: the loader keeps them out)."""
    count = _swap_linears(model)
    model.batch_invariant = True  # type: ignore[assignment]
    return count


def _swap_linears(model: nn.Module) -> int:
    count = 0
    for name, child in list(model.named_children()):
        if type(child) in _PLAIN:
            setattr(model, name, BatchInvariantLinear(child))  # type: ignore[arg-type]
            count += 1
        elif isinstance(child, WideLinear):
            child.direct_rows = 0  # the kernel for every row count
            count += 1
        elif isinstance(child, QuantLinear):
            _fix_quantized(name, child)
            count += 1
        elif "Linear" in type(child).__name__ and not isinstance(child, BatchInvariantLinear):
            raise ValueError(f"batch-invariant mode has no fixed-order path for {name} "
                             f"({type(child).__name__})")  # fmt: skip
        else:
            count += _swap_linears(child)
    return count
