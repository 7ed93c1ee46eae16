"""The per-layer attention options every implementation takes, checked one way.

``sliding_window`` (a query sees its last ``window`` keys), ``soft_cap`` (scores
``cap * tanh(s / cap)``) and ``sinks`` (a logit per query head in the softmax) vary by
layer; the reference, the SDPA paths, the C++ kernel and the Triton kernels all refuse the same
bad values. Here, on the ground floor, so that
``kvserve/ops/triton`` and ``kvserve/attention`` share it.
"""

from __future__ import annotations

import torch


def check_attention_options(
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
    num_heads: int | None = None,
) -> None:
    """ValueError for a window below 1, a soft-cap that is not positive, or ``sinks`` that
    are not one floating-point logit per query head ``[num_heads]`` (None: unset)."""
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor)
        or not sinks.is_floating_point()
        or sinks.dim() != 1
        or (num_heads is not None and sinks.shape[0] != num_heads)
    ):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"sinks must be a float tensor of one logit per query head [{num_heads}], got {shape}"
        )
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
