"""One MoE layer's routed experts in one C++ call (``csrc/moe_experts.cpp``).

``grouped_experts`` (PyTorch) loops in Python over the experts that got tokens, three kernel
calls each; ``MoEExperts`` does the same grouping, matmuls and weighted scatter in C++: the
pairs counting-sorted by expert, each active expert's gate/up, activation and down over its
rows through kvserve's own kernels (``wide_linear`` for dense experts, ``quant_linear`` /
``quant_linear_a8`` for ``QuantLinear`` ones, exactly as those layers call them), experts side
by side on the thread pool, and the rounding of ``grouped_experts`` (its docstring).

``experts_kernel`` builds the op for one layer's weights, or says why it cannot
(``ExpertsKernelRefused``); ``FusedExperts`` then keeps the PyTorch path and logs the reason
once. ``grouped_experts`` and ``reference_experts`` stay the references the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.moe.experts import GluActivation, GluKind
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear

# csrc/moe_experts.cpp's codes (its linear kinds are decode_layers.cpp's numbers)
_ACT = {GluKind.SILU: 0, GluKind.GELU_TANH: 1, GluKind.CLAMPED_SWIGLU: 2}
_A8, _QUANT, _WIDE = 0, 1, 4
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # wide_linear's


@dataclass(frozen=True)
class PackedExpert:
    """One expert's 16-bit weight packed as ``[ceil(N / 16), K, 16]`` (``pack_wide_weight``),
    read by ``wide_linear_packed``; ``out_features`` its N."""

    packed: torch.Tensor
    out_features: int


# stacked dense weights [E, N, K], one layer per expert (QuantLinear), or packed weights
StackedOrLayers = torch.Tensor | Sequence[nn.Module] | Sequence[PackedExpert]


class ExpertsKernelRefused(ValueError):
    """Why the C++ op cannot run these experts (the PyTorch path then runs them)."""


def _add_dense(op: torch.ScriptObject, w: torch.Tensor) -> None:
    """A dense expert's ``[N, K]`` weight, through ``wide_linear``."""
    if w.dtype not in _WEIGHT_DTYPES or w.device.type != "cpu":
        raise ExpertsKernelRefused(f"dense experts in {w.dtype} on {w.device.type}")
    empty = torch.empty(0)
    op.add_linear(_WIDE, w.detach().contiguous(), empty, empty, w.shape[0], 0, 0, 0, 0, 0, False)


def _add_packed(op: torch.ScriptObject, w: PackedExpert) -> None:
    """A dense expert's packed 16-bit weight, through ``wide_linear_packed``."""
    empty = torch.empty(0)
    op.add_linear(_WIDE, w.packed, empty, empty, w.out_features, 0, 0, 0, 0, 0, False)


def _add_quant(op: torch.ScriptObject, layer: nn.Module) -> None:
    """One expert's ``QuantLinear``, on the kernel its own forward calls."""
    if not isinstance(layer, QuantLinear):
        raise ExpertsKernelRefused(f"an expert layer of type {type(layer).__name__}")
    if layer.path == "reference" or layer.in_perm is not None or layer.bias is not None:
        raise ExpertsKernelRefused(
            "a quantized expert on the reference path, with act-order or with a bias"
        )
    empty = torch.empty(0)
    if layer.path == "a8":
        op.add_linear(_A8, layer.codes, empty, empty, layer.out_features, layer.code_bits,
                      layer.group_size, layer.offset, 0, layer.scale_format,
                      layer.has_zeros)  # fmt: skip
    else:
        op.add_linear(_QUANT, layer.codes, layer.scales_t, layer.zeros_t, layer.out_features,
                      layer.code_bits, layer.group_size, layer.offset, layer.direct_rows, 0,
                      layer.has_zeros)  # fmt: skip


def experts_kernel(
    gate_up: StackedOrLayers,
    down: StackedOrLayers,
    act: GluActivation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.ScriptObject:
    """The C++ op for ``E`` experts: ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` stacked
    dense weights, or ``E`` ``QuantLinear``s each; ``act`` the activation between them;
    biases ``[E, 2I]`` / ``[E, H]`` in the model dtype. Its ``run(x [T, H], weights [T, k],
    ids [T, k])`` is ``grouped_experts``' result. Raises ``ExpertsKernelRefused``."""
    if not cpu_kernels.available():
        raise ExpertsKernelRefused("the C++ CPU kernels are not built")
    if len(gate_up) != len(down) or len(gate_up) == 0:
        raise ExpertsKernelRefused("gate/up and down hold different numbers of experts")
    op = torch.classes.kvserve.MoEExperts(_ACT[act.kind], act.alpha, act.limit)
    for e in range(len(gate_up)):
        for part in (gate_up[e], down[e]):
            if isinstance(part, torch.Tensor):
                _add_dense(op, part)
            elif isinstance(part, PackedExpert):
                _add_packed(op, part)
            else:
                _add_quant(op, part)
    op.set_biases(*(None if b is None else b.detach() for b in (gate_up_bias, down_bias)))
    return op
