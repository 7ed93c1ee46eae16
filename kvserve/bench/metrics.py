"""Benchmark metrics from per-request records: throughput, latency statistics and goodput.

Definitions (all as in ``vllm bench serve``):

* only successful requests count towards tokens, throughput and latency statistics; failed ones
  are only counted in ``failed``;
* ``request_throughput = completed / duration``, ``output_throughput = output tokens /
  duration``, ``total_token_throughput = (input + output tokens) / duration``;
* TPOT of a request = ``(e2e latency - TTFT) / (output_tokens - 1)``; requests with a single
  output token have no TPOT and are left out of its statistics;
* ITL statistics pool every inter-chunk gap of every successful request;
* percentiles use linear interpolation (``numpy.percentile``); the standard deviation is the
  population one (``numpy.std``);
* goodput counts the completed requests that meet *every* given SLO (ms), for TPOT treating a
  one-token request as 0 ms, divided by the duration.

One deliberate difference: a statistic with no data (every request failed, or no request
produced two tokens for TPOT) is ``None`` (JSON ``null``), not vLLM's 0, so that an empty
measurement is never mistaken for a fast one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.bench.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")
_SLO_ALIASES = {"e2e": "e2el", "e2e_latency": "e2el", "latency": "e2el"}


@dataclass
class BenchmarkMetrics:
    """Aggregate results of one benchmark run; ``to_dict`` gives vLLM's result keys."""

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    # "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_e2el_ms", ... -> value or None
    latency: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        out.update(self.latency)
        return out


def percentile_key(p: float) -> str:
    """``99 -> "p99"``, ``99.9 -> "p99.9"`` (vLLM's naming)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values: Sequence[float], name: str, percentiles: Iterable[float]) -> dict:
    """mean/median/std/percentiles of ``values`` (seconds), in ms, under vLLM's key names."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"{percentile_key(p)}_{name}_ms" for p in percentiles]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    stats = [float(np.mean(arr)), float(np.median(arr)), float(np.std(arr))]
    stats += [float(np.percentile(arr, p)) for p in percentiles]
    return dict(zip(keys, stats, strict=True))


def request_tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first, or None for a one-token output."""
    if record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once, over half-open intervals [start, start + latency)."""
    events = []
    for r in records:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    events.sort()  # at equal times the -1 sorts first: an end frees its slot before a start
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def meets_slo(record: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """True when ``record`` meets every SLO (vLLM: a one-token request has TPOT 0)."""
    measured = {
        "ttft": record.ttft,
        "tpot": request_tpot(record) or 0.0,
        "e2el": record.latency,
    }
    return all(measured[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    slo: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate ``records`` of a run that took ``duration`` seconds (see module docstring)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}.")
    percentiles = list(percentiles)
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    latency: dict[str, float | None] = {}
    for name in LATENCY_METRICS:
        latency.update(summarize(samples[name], name, percentiles))
    goodput = None
    if slo:
        checked = normalize_slo(slo)
        goodput = sum(1 for r in ok if meets_slo(r, checked)) / duration
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_concurrent_requests=peak_concurrency(ok),
        latency=latency,
    )


def total_cached_tokens(records: Iterable[RequestRecord]) -> int | None:
    """Prompt tokens the server's prefix cache served to the successful requests, from
    ``usage.prompt_tokens_details.cached_tokens``; None when no request reported it (a server
    without the field must not read as a 0% hit rate)."""
    reported = [r.cached_tokens for r in records if r.success and r.cached_tokens is not None]
    return sum(reported) if reported else None


def normalize_slo(slo: dict[str, float]) -> dict[str, float]:
    """Map SLO names to ``ttft``/``tpot``/``e2el`` and check them; values are milliseconds."""
    out: dict[str, float] = {}
    for raw_name, value in slo.items():
        name = _SLO_ALIASES.get(raw_name.strip().lower(), raw_name.strip().lower())
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {raw_name!r}; use one of {list(SLO_METRICS)}.")
        if value < 0:
            raise ValueError(f"SLO {raw_name} must be non-negative, got {value}.")
        out[name] = float(value)
    return out


def _parse_pairs(items: Iterable[str], sep: str, flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, found, value = item.partition(sep)
        if not found or not name.strip():
            raise ValueError(f"{flag} expects NAME{sep}MS pairs, got {item!r}.")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: {value!r} is not a number of milliseconds.") from None
    return normalize_slo(out)


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50 e2el:2000`` (milliseconds)."""
    return _parse_pairs(pairs, ":", "--goodput")


def parse_slo(spec: str) -> dict[str, float]:
    """``--slo ttft=500,tpot=50,e2e=2000`` (milliseconds)."""
    return _parse_pairs([p for p in spec.split(",") if p.strip()], "=", "--slo")


def parse_percentiles(spec: str | None) -> list[float]:
    """Percentiles to report: p90 and p99 always, plus any of ``"50,90,99.9"`` (each in
    [0, 100]), sorted without duplicates."""
    values = set(DEFAULT_PERCENTILES)
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        p = float(item)
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentiles must be in [0, 100], got {p}.")
        values.add(p)
    return sorted(values)
