"""Llama 3's rope scaling from a GGUF's ``rope_freqs.weight``.

llama.cpp's converter does not store Llama 3.1/3.2's rope parameters (``rope_type: llama3``
with ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
it stores what they compute: one divisor per rotary frequency (``rope_freqs.weight``, ``[d/2]``),
1 for the high frequencies, ``factor`` for the low ones and a smooth ramp between
(``conversion/llama.py``, ``generate_extra_tensors``; its rope kernels divide each frequency by
it). kvserve's models take rope settings from a Hugging Face config, so the parameters are
solved back from the divisors:

* ``factor`` is the largest divisor;
* on the ramp ``1 / r = (1 - s) / factor + s`` with ``s = (L / wavelength - lo) / (hi - lo)``, a
  straight line in ``1 / wavelength``; its slope and intercept give ``hi - lo`` and ``lo`` for
  a chosen ``L`` (8192, which the converter also assumes when the config has none; only
  ``L / (hi - lo)`` and ``lo / (hi - lo)`` change the result, so any ``L`` is exact);
* with fewer than two ramp frequencies (small heads) the line is any one that puts the ramp
  between the last divisor of 1 and the first of ``factor``.

The solved parameters are checked by recomputing the divisors; a tensor they do not reproduce
(within float32 rounding) is refused rather than approximated.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The converter's default original context, used as L above (any value gives the same divisors).
ORIGINAL_CONTEXT = 8192
_TOL = 1e-5  # relative: the divisors are float32


def rope_divisors(inv_freq: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for ``params`` (``rope_type: llama3``): ``[d/2]`` float64."""
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq.astype(np.float64)
    smooth = (old / wavelen - lo) / (hi - lo)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, ramp))


def llama3_rope_scaling(divisors: np.ndarray, inv_freq: np.ndarray) -> dict[str, Any] | None:
    """The ``rope_type: llama3`` parameters whose divisors are ``divisors`` (``[d/2]``) for
    the unscaled frequencies ``inv_freq`` (``[d/2]``, as the converter computes them); None
    when every divisor is 1. ValueError when no such parameters reproduce them."""
    r = divisors.astype(np.float64)
    if r.shape != inv_freq.shape:
        raise ValueError(f"rope_freqs.weight has {r.size} values, the heads have "
                         f"{inv_freq.size} rotary frequencies")  # fmt: skip
    if np.all(np.abs(r - 1) <= _TOL):
        return None
    factor = float(r.max())
    x = inv_freq.astype(np.float64) / (2 * math.pi)  # 1 / wavelength
    ones, full = r <= 1 + _TOL, r >= factor * (1 - _TOL)
    ramp = ~ones & ~full
    s = (1 / r - 1 / factor) / (1 - 1 / factor)  # 1 on the high frequencies, 0 on the low
    if ramp.sum() >= 2:
        slope, intercept = np.polyfit(x[ramp], s[ramp], 1)
    elif ones.any() and full.any() and x[ones].min() > x[full].max():
        # Any line through the ramp point (or the gap's middle) that is >= 1 on every
        # divisor of 1 and <= 0 on every divisor of `factor`.
        x1, x0 = x[ones].min(), x[full].max()
        xm, sm = (x[ramp][0], s[ramp][0]) if ramp.any() else ((x0 + x1) / 2, 0.5)
        slope = 2 * max((1 - sm) / (x1 - xm), sm / (xm - x0))
        intercept = sm - slope * xm
    else:
        slope, intercept = 0.0, 0.0
    params = _from_line(factor, slope, intercept)
    if params is None or not np.allclose(rope_divisors(inv_freq, params), r, rtol=1e-4):
        raise ValueError("rope_freqs.weight is not Llama 3 rope scaling (factor, low/high "
                         "frequency factors): kvserve cannot express it")  # fmt: skip
    return _tidy(params, inv_freq)


def _from_line(factor: float, slope: float, intercept: float) -> dict[str, Any] | None:
    """``s = slope / wavelength + intercept`` as llama3 parameters, or None if the line
    cannot be one (it must rise with the frequency and be negative at frequency 0)."""
    if slope <= 0 or intercept >= 0:
        return None
    span = ORIGINAL_CONTEXT / float(slope)  # hi - lo
    lo = -float(intercept) * span
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo,
            "high_freq_factor": lo + span,
            "original_max_position_embeddings": ORIGINAL_CONTEXT}  # fmt: skip


def _tidy(params: dict[str, Any], inv_freq: np.ndarray) -> dict[str, Any]:
    """``params`` with the frequency factors rounded to the fewest decimals that leave the
    divisors unchanged (Llama 3.1's 1 and 4 come back as 0.99999994 and 4.0000005)."""
    want = rope_divisors(inv_freq, params)
    for decimals in range(7):
        lo, hi = (round(params[k], decimals) for k in ("low_freq_factor", "high_freq_factor"))
        tidy = {**params, "low_freq_factor": lo, "high_freq_factor": hi}
        if 0 < lo < hi and np.allclose(rope_divisors(inv_freq, tidy), want, rtol=1e-6):
            return tidy
    return params
