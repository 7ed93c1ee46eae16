"""Request arrival schedules: when each benchmark request is sent, relative to the start.

Gaps between requests follow a gamma distribution with shape ``burstiness`` and mean
``1 / request_rate`` (vLLM's model): ``burstiness = 1`` is a Poisson process (exponential
gaps), smaller values give burstier traffic (gap variance ``1 / (rate^2 * burstiness)``), larger
ones smoother traffic, and ``inf`` (or ``distribution="constant"``) evenly spaced requests. A
rate of ``inf`` sends everything at once. The concurrency cap is not a property of the
schedule: the runner applies it with a semaphore (see :mod:`kvserve.bench.runner`).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

Distribution = Literal["poisson", "constant"]


def arrival_times(
    n: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    distribution: Distribution = "poisson",
    normalize: bool = False,
) -> list[float]:
    """Send offsets in seconds for ``n`` requests; the first request goes at 0.

    ``normalize=True`` rescales a random schedule so that its last request lands exactly at
    ``(n - 1) / request_rate``: like vLLM, this removes the run-to-run noise in the *offered*
    load (a 50-request Poisson schedule is otherwise ~14% off the asked rate) while keeping the
    shape of the gaps. It is off by default so that the raw process can be studied.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}.")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}.")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive (or inf), got {burstiness}.")
    if distribution not in ("poisson", "constant"):
        raise ValueError(f"unknown distribution {distribution!r}; use 'poisson' or 'constant'.")
    if n == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if distribution == "constant" or math.isinf(burstiness):
        return [i / request_rate for i in range(n)]

    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=theta) has mean k*theta; theta = 1/(rate*k) gives mean 1/rate.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    offsets = np.concatenate([[0.0], np.cumsum(gaps)])
    if normalize and n > 1 and offsets[-1] > 0:
        offsets *= ((n - 1) / request_rate) / offsets[-1]
    return offsets.tolist()
