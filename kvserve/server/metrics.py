"""Prometheus metrics: the only module that knows Prometheus.

Engine totals and gauges are read from each engine's published stats snapshot at scrape time
by a custom collector (nothing to keep in sync, no double counting). Per-request latencies are
histograms fed by the engines' finished-request callbacks. Every server gets its own
``CollectorRegistry``, so several servers (or tests) in one process never collide.

Names follow vLLM's (``vllm:`` -> ``kvserve:``), with units in the names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.outputs import RequestOutput

StatsFn = Callable[[], dict[str, Any]]
LABEL = "model_name"

# (stats key, metric name, help) for gauges and for counters read from the snapshot.
_GAUGES = [
    ("num_running", "kvserve:num_requests_running", "Requests in the running batch."),
    ("num_queued", "kvserve:num_requests_waiting", "Requests waiting to run."),
    ("num_swapped", "kvserve:num_requests_swapped", "Requests swapped out to CPU."),
    ("kv_usage", "kvserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."),
    ("max_num_running", "kvserve:max_num_requests_running",
     "The most requests that ran in one step since start."),
    ("num_kv_blocks", "kvserve:num_kv_blocks", "KV cache blocks on the device."),
]  # fmt: skip
_COUNTERS = [
    ("num_preemptions", "kvserve:num_preemptions", "Preemptions since start."),
    ("num_prompt_tokens", "kvserve:prompt_tokens", "Prompt tokens of admitted requests."),
    ("num_generation_tokens", "kvserve:generation_tokens", "Generated tokens."),
    # vLLM's names and meaning: tokens looked up in the prefix cache at admission, and how
    # many of them were found (hits / queries is the token-weighted hit rate).
    ("prefix_cache_queries", "kvserve:prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "kvserve:prefix_cache_hits",
     "Prompt tokens found in the prefix cache (not computed again)."),
]  # fmt: skip

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Yields the snapshot-based gauges and counters, one label set per model."""

    def __init__(self) -> None:
        self.engines: dict[str, StatsFn] = {}

    def collect(self) -> Iterator[Metric]:
        snapshots = {name: fn() for name, fn in self.engines.items()}
        for key, name, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=[LABEL])
            for model, stats in snapshots.items():
                g.add_metric([model], float(stats.get(key) or 0))
            yield g
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=[LABEL])
            for model, stats in snapshots.items():
                c.add_metric([model], float(stats.get(key) or 0))
            yield c
        h = GaugeMetricFamily(
            "kvserve:engine_healthy", "1 if the engine is serving.", labels=[LABEL]
        )
        for model, stats in snapshots.items():
            h.add_metric([model], 1.0 if stats.get("healthy", True) else 0.0)
        yield h


class ServerMetrics:
    """Metrics of one server; register engines with ``add_engine``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._collector = _EngineStatsCollector()
        self.registry.register(self._collector)
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds", "Time to first token.", [LABEL],
            buckets=_TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "kvserve:time_per_output_token_seconds", "Mean time per output token after the first.",
            [LABEL], buckets=_TPOT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds", "Arrival to finish.", [LABEL],
            buckets=_E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queue = Histogram(
            "kvserve:request_queue_time_seconds", "Arrival to first scheduled.", [LABEL],
            buckets=_E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.success = Counter(
            "kvserve:request_success", "Finished requests by finish reason.",
            [LABEL, "finished_reason"], registry=self.registry,
        )  # fmt: skip

    def add_engine(self, model_name: str, stats: StatsFn) -> Callable[[RequestOutput], None]:
        """Export ``stats()`` under ``model_name``; returns the finished-request callback to
        hand to the engine (it may run in the engine thread: Prometheus objects are
        thread-safe)."""
        self._collector.engines[model_name] = stats
        return lambda out: self.observe_finished(model_name, out)

    def observe_finished(self, model_name: str, out: RequestOutput) -> None:
        for c in out.outputs:
            if c.finish_reason is not None:
                self.success.labels(model_name, c.finish_reason).inc()
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.labels(model_name).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(model_name).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(model_name).observe(m.first_token_time - m.arrival_time)
            num_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
            if num_tokens > 1:
                self.tpot.labels(model_name).observe(
                    (m.finished_time - m.first_token_time) / (num_tokens - 1)
                )

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for ``GET /metrics``."""
        return _generate_latest(self.registry), CONTENT_TYPE_LATEST
