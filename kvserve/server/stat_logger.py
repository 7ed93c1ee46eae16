"""vLLM's periodic stats line: throughput, running and waiting requests, KV cache use.

Every ``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's variable, default 10) one line per model,
from the engines' published stats snapshots (the ones ``/metrics`` reads); at INFO while
anything ran since the last line or is running or waiting, else at DEBUG, as vLLM does, so an
idle server stays quiet. ``--disable-log-stats`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvserve.stats")

INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class StatsSample:
    """The counters a stats line is computed from, at one instant."""

    time: float
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: float
    prefix_hits: float

    @classmethod
    def of(cls, stats: Mapping[str, Any], now: float) -> StatsSample:
        return cls(
            now,
            float(stats.get("num_prompt_tokens") or 0),
            float(stats.get("num_generation_tokens") or 0),
            float(stats.get("prefix_cache_queries") or 0),
            float(stats.get("prefix_cache_hits") or 0),
        )


def stats_line(name: str, prev: StatsSample, now: StatsSample, stats: Mapping[str, Any]) -> str:
    """The line for one model over ``prev`` -> ``now`` (vLLM's wording)."""
    dt = max(now.time - prev.time, 1e-9)
    queries = now.prefix_queries - prev.prefix_queries
    hits = now.prefix_hits - prev.prefix_hits
    return (
        f"{name}: Avg prompt throughput: {(now.prompt_tokens - prev.prompt_tokens) / dt:.1f} "
        f"tokens/s, Avg generation throughput: "
        f"{(now.generation_tokens - prev.generation_tokens) / dt:.1f} tokens/s, "
        f"Running: {int(stats.get('num_running') or 0)} reqs, "
        f"Waiting: {int(stats.get('num_queued') or 0)} reqs, "
        f"KV cache usage: {100 * float(stats.get('kv_usage') or 0):.1f}%, "
        f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
    )


def log_interval() -> float:
    """``VLLM_LOG_STATS_INTERVAL`` in seconds (ValueError if not a positive number)."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{INTERVAL_ENV} must be a positive number of seconds, got {raw!r}")
    return value


class StatLogger:
    """Logs each engine's stats line every ``interval`` seconds in a daemon thread."""

    def __init__(
        self,
        engines: Callable[[], Mapping[str, Callable[[], Mapping[str, Any]]]],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engines = engines  # name -> stats() of the engines serving now
        self._interval = interval
        self._clock = clock
        self._prev: dict[str, StatsSample] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-stats", daemon=True)

    def start(self) -> None:
        self.log_once()  # the baseline: counters since start-up are not this interval's
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.log_once()
            except Exception:  # a stats line must never take the server down
                logger.exception("stats logging failed")

    def log_once(self) -> list[str]:
        """Log (and return) one line per engine; the first call per engine only records."""
        lines = []
        for name, stats_fn in self._engines().items():
            stats = stats_fn()
            now = StatsSample.of(stats, self._clock())
            prev = self._prev.get(name)
            self._prev[name] = now
            if prev is None:
                continue
            line = stats_line(name, prev, now, stats)
            busy = (now.prompt_tokens, now.generation_tokens) != (
                prev.prompt_tokens, prev.generation_tokens,
            ) or stats.get("num_running") or stats.get("num_queued")  # fmt: skip
            logger.log(logging.INFO if busy else logging.DEBUG, "%s", line)
            lines.append(line)
        return lines
