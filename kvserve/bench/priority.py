"""Mixed-priority traffic: ``bench serve --priority-mix 0:0.2,1:0.8``.

Each request carries vLLM's ``priority`` field (lower runs first under ``--scheduling-policy
priority``, in vLLM and in kvserve; a FCFS server ignores it), with exactly the asked share of
requests per value (largest remainders) in a seeded random order, so two runs with the same
seed send the same priority with the same prompt. The result then holds every metric again
per priority class (``by_priority``), and the few a table needs as flat keys
(``priority_0_p99_ttft_ms``): the question is what a high-priority request's TTFT is while
the server is overloaded with the rest.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from kvserve.bench.client import RequestRecord
from kvserve.bench.metrics import calculate_metrics

FLAT_KEYS = ("completed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "request_goodput")


def parse_priority_mix(spec: str) -> list[tuple[int, float]]:
    """``"0:0.2,1:0.8"`` -> [(0, 0.2), (1, 0.8)]; shares must be positive and sum to 1."""
    mix = []
    for part in spec.split(","):
        value, sep, share = part.partition(":")
        try:
            pair = (int(value), float(share))
        except ValueError:
            pair = None
        if not sep or pair is None or not pair[1] > 0:
            raise ValueError(f"--priority-mix takes PRIORITY:SHARE pairs, got {part!r}")
        mix.append(pair)
    if len({v for v, _ in mix}) != len(mix) or not math.isclose(sum(s for _, s in mix), 1.0):
        raise ValueError(
            f"--priority-mix needs distinct priorities whose shares sum to 1: {spec!r}"
        )
    return mix


def assign_priorities(mix: Sequence[tuple[int, float]], n: int, seed: int) -> list[int]:
    """``n`` priorities, ``round``-ed shares by largest remainder, shuffled with ``seed``."""
    exact = [share * n for _, share in mix]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(mix)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    labels = [v for (v, _), c in zip(mix, counts, strict=True) for _ in range(c)]
    random.Random(seed).shuffle(labels)
    return labels


def by_priority(
    records: Sequence[RequestRecord],
    priorities: Sequence[int],
    duration: float,
    percentiles: Sequence[float],
    slo: dict[str, float] | None,
) -> dict[str, Any]:
    """``by_priority`` (every metric per class, over the run's whole duration) and the flat
    ``priority_{value}_{key}`` keys of :data:`FLAT_KEYS`."""
    out: dict[str, Any] = {"by_priority": {}}
    for value in sorted(set(priorities)):
        subset = [r for r, p in zip(records, priorities, strict=True) if p == value]
        metrics = calculate_metrics(subset, duration, percentiles, slo).to_dict()
        out["by_priority"][str(value)] = metrics
        for key in FLAT_KEYS:
            out[f"priority_{value}_{key}"] = metrics.get(key)
    return out
