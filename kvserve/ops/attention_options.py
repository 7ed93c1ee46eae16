"""The per-layer attention options every implementation takes, checked one way.

``sliding_window`` (a query sees its last ``window`` keys) and ``soft_cap`` (scores
``cap * tanh(s / cap)``) vary by layer; the reference, the SDPA paths, the C++ kernel and the
Triton kernels all refuse the same bad values. Here, on the ground floor, so that
``kvserve/ops/triton`` and ``kvserve/attention`` share it.
"""

from __future__ import annotations


def check_attention_options(sliding_window: int | None, soft_cap: float | None) -> None:
    """ValueError for a window below 1 or a soft-cap that is not positive (None: unset)."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
