"""Prometheus metrics: the only module that knows Prometheus.

Names, labels, buckets and meanings are vLLM v1's (``vllm/v1/metrics/loggers.py``) under a
configurable prefix (``--metrics-prefix``, default ``kvserve``; ``vllm`` makes a kvserve
server look like vLLM to existing dashboards and alerts). Every series carries vLLM's labels
``model_name`` and ``engine`` (always ``"0"``: one engine per served model).

Three sources, so that nothing is counted twice and nothing needs keeping in sync:

* engine totals and gauges are read from each engine's published stats snapshot at scrape
  time by a custom collector;
* per-step facts (inter-token latency, tokens per step, time to first token) come from the
  async engine's step callback, in the engine thread, before the step's outputs reach their
  streams: a stream coalesces outputs its consumer has not taken, so only there is every
  step visible (vLLM observes them where engine-core outputs reach its front end);
* per-request histograms are observed when a request finishes (the same callback) and, for
  the request's parameters (``n``, ``max_tokens``), by the server at admission.

Every server gets its own ``CollectorRegistry``, so several servers (or tests) in one process
never collide.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvserve.outputs import CompletionOutput, EmbeddingRequestOutput, EngineOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncLLMEngine

StatsFn = Callable[[], dict[str, Any]]
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # vLLM numbers the engines of a data-parallel model; here one per model
DEFAULT_PREFIX = "kvserve"
FINISH_REASONS = ("stop", "length", "abort", "error")
_PREFIX_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# (stats key, name, help) of the snapshot gauges and counters. Counters are named without
# `_total`: the exposition adds it, as vLLM's scrape shows (vllm:prompt_tokens_total).
_GAUGES = [
    ("num_running", "num_requests_running", "Number of requests in model execution batches."),
    ("num_queued", "num_requests_waiting", "Number of requests waiting to be processed."),
    ("num_swapped", "num_requests_swapped", "Number of requests swapped out to CPU."),
    ("kv_usage", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("max_num_running", "max_num_requests_running",
     "The most requests that ran in one step since start."),
    ("num_kv_blocks", "num_kv_blocks", "KV cache blocks on the device."),
]  # fmt: skip
_COUNTERS = [
    ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
    ("num_background_rows_held", "num_background_rows_held",
     "Batch API rows held out of a step that computed an online request's prompt."),
    ("num_background_steps_interrupted", "num_background_steps_interrupted",
     "Steps given up between layers for an online request (Batch API rows only, or "
     "online rows all aborted)."),
    ("num_prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("num_generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("prefix_cache_queries", "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens."),
]  # fmt: skip
# Speculative decoding (vLLM's SpecDecodingProm), exported when the engine reports them.
_SPEC_COUNTERS = [
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Number of accepted tokens."),
]  # fmt: skip

# vLLM's buckets
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# One per batch size up to 16, then x1.5/x2 steps: a benchmark reads its run's exact peak
# batch from the bucket deltas wherever it is at most 16 (a bound above that).
_RUNNING_BUCKETS = (*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                    2048, 4096)  # fmt: skip


# (key, name, help, buckets) of the histograms with fixed buckets
_HISTOGRAMS: list[tuple[str, str, str, tuple[float, ...]]] = [
    ("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     _TTFT_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     _ITL_BUCKETS),
    # vLLM keeps the old per-token name (deprecated) beside inter_token_latency_seconds; older
    # dashboards read it
    ("tpot", "time_per_output_token_seconds",
     "Histogram of time per output token in seconds. DEPRECATED: Use "
     "inter_token_latency_seconds instead.", _ITL_BUCKETS),
    ("request_tpot", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     _REQUEST_BUCKETS),
    ("queue", "request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS),
    ("inference", "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS),
    ("prefill", "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS),
    ("decode", "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS),
    ("iteration", "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     _ITERATION_BUCKETS),
    ("params_n", "request_params_n", "Histogram of the n request parameter.", _N_BUCKETS),
]  # fmt: skip
# (key, name, help) of the token-count histograms (1-2-5 buckets up to max_model_len)
_TOKEN_HISTOGRAMS = [
    ("prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "request_generation_tokens", "Number of generation tokens processed."),
    ("max_generation_tokens", "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens."),
    ("params_max_tokens", "request_params_max_tokens",
     "Histogram of the max_tokens request parameter."),
    ("prefill_kv_computed", "request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
]  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def cumulative_at(counts: dict[int, int], le: float) -> int:
    """How many of ``counts``' observations ({value: times}) are at most ``le``."""
    return sum(k for n, k in counts.items() if n <= le)


def check_prefix(prefix: str) -> str:
    """A metric name prefix (the part before ``:``); raises ValueError if not a valid one."""
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"metrics_prefix (--metrics-prefix) must be letters, digits and '_' and not start "
            f"with a digit, got {prefix!r}"
        )
    return prefix


def _completions(out: EngineOutput) -> list[CompletionOutput]:
    """A request's choices; none for an embedding request (it generates no token)."""
    return [] if isinstance(out, EmbeddingRequestOutput) else out.outputs


def request_finish_reason(out: EngineOutput) -> str:
    """One reason per request (``request_success_total`` counts requests, not the n
    choices): the most severe of its choices' reasons, error > abort > length > stop (an
    embedding request that ran: stop)."""
    reasons = {c.finish_reason for c in _completions(out)}
    if out.error is not None:
        return "error"
    return next((r for r in FINISH_REASONS[::-1] if r in reasons), "stop")


class _EngineStatsCollector(Collector):
    """Yields the snapshot-based gauges and counters, one label set per model."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.engines: dict[str, StatsFn] = {}
        self.cache_info: dict[str, dict[str, str]] = {}  # model -> cache_config_info labels
        self.paths_info: dict[str, dict[str, str]] = {}  # model -> execution_paths_info labels

    def collect(self) -> Iterator[Metric]:
        p = self.prefix
        snapshots = {name: fn() for name, fn in self.engines.items()}
        for key, name, doc in _GAUGES:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=LABELS)
            for model, stats in snapshots.items():
                g.add_metric([model, ENGINE_INDEX], float(stats.get(key) or 0))
            yield g
        spec = [c for c in _SPEC_COUNTERS if any(c[0] in s for s in snapshots.values())]
        for key, name, doc in _COUNTERS + spec:
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=LABELS)
            for model, stats in snapshots.items():
                c.add_metric([model, ENGINE_INDEX], float(stats.get(key) or 0))
            yield c
        yield self._steps_by_running(snapshots)
        yield from self._per_position(snapshots)
        yield from self._lora_info(snapshots)
        h = GaugeMetricFamily(f"{p}:engine_healthy", "1 if the engine is serving.", labels=LABELS)
        for model, stats in snapshots.items():
            h.add_metric([model, ENGINE_INDEX], 1.0 if stats.get("healthy", True) else 0.0)
        yield h
        if self.cache_info:
            keys = sorted(next(iter(self.cache_info.values())))
            info = GaugeMetricFamily(
                f"{p}:cache_config_info", "Information of the LLMEngine CacheConfig",
                labels=[*keys, "model_name"],
            )  # fmt: skip
            for model, labels in self.cache_info.items():
                info.add_metric([labels[k] for k in keys] + [model], 1.0)
            yield info
        if self.paths_info:
            keys = sorted(next(iter(self.paths_info.values())))
            paths = GaugeMetricFamily(
                f"{p}:execution_paths_info", "The paths rank 0 took (ExecutionPaths)",
                labels=[*keys, "model_name"],
            )  # fmt: skip
            for model, labels in self.paths_info.items():
                paths.add_metric([labels[k] for k in keys] + [model], 1.0)
            yield paths

    def _steps_by_running(self, snapshots: dict[str, dict[str, Any]]) -> Metric:
        """The engine's steps by batch size as a histogram (exact counts, kept by the
        scheduler: polling ``num_requests_running`` misses a short peak)."""
        h = HistogramMetricFamily(
            f"{self.prefix}:step_num_requests_running",
            "Histogram of the number of requests running in each engine step.", labels=LABELS,
        )  # fmt: skip
        for model, stats in snapshots.items():
            counts: dict[int, int] = stats.get("num_steps_by_running") or {}
            buckets = [
                (str(float(le)), float(cumulative_at(counts, le))) for le in _RUNNING_BUCKETS
            ]
            buckets.append(("+Inf", float(sum(counts.values()))))
            total = float(sum(n * k for n, k in counts.items()))
            h.add_metric([model, ENGINE_INDEX], buckets, total)
        return h

    def _lora_info(self, snapshots: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        """vLLM's ``lora_requests_info`` (engines with LoRA on): the adapters of the running
        and of the waiting requests, comma-separated, and ``max_lora`` as labels; the value is
        the wall-clock time the engine last updated them (after its last step)."""
        loras = {m: s["lora"] for m, s in snapshots.items() if s.get("lora")}
        if not loras:
            return
        g = GaugeMetricFamily(
            f"{self.prefix}:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", *LABELS],
        )  # fmt: skip
        for model, info in loras.items():
            labels = [str(info["max_lora"]), ",".join(info["running"]),
                      ",".join(info["waiting"]), model, ENGINE_INDEX]  # fmt: skip
            g.add_metric(labels, float(info["updated"]))
        yield g

    def _per_position(self, snapshots: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        """vLLM's accepted draft tokens by their position in the proposal."""
        if not any("spec_decode_accepted_per_pos" in s for s in snapshots.values()):
            return
        c = CounterMetricFamily(
            f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", labels=[*LABELS, "position"],
        )  # fmt: skip
        for model, stats in snapshots.items():
            for pos, n in enumerate(stats.get("spec_decode_accepted_per_pos") or []):
                c.add_metric([model, ENGINE_INDEX, str(pos)], float(n))
        yield c


class _ModelMetrics:
    """One model's bound histogram children and the per-sequence state of its requests in
    flight: for each request id, per choice, (tokens seen, time of the step that last gave
    it tokens)."""

    def __init__(self, m: ServerMetrics, model: str) -> None:
        h = {key: hist.labels(model, ENGINE_INDEX) for key, hist in m.histograms.items()}
        # attributes, not dict lookups, on the per-step path
        self.ttft, self.itl, self.tpot = h["ttft"], h["itl"], h["tpot"]
        self.request_tpot, self.e2e, self.queue = h["request_tpot"], h["e2e"], h["queue"]
        self.prefill, self.decode, self.inference = h["prefill"], h["decode"], h["inference"]
        self.iteration, self.params_n = h["iteration"], h["params_n"]
        self.prompt_tokens, self.generation_tokens = h["prompt_tokens"], h["generation_tokens"]
        self.max_generation_tokens = h["max_generation_tokens"]
        self.params_max_tokens = h["params_max_tokens"]
        self.prefill_kv_computed = h["prefill_kv_computed"]
        self.success = {r: m.success.labels(model, ENGINE_INDEX, r) for r in FINISH_REASONS}
        self.clock = m.clock
        self.live: dict[str, list[list[float]]] = {}

    def on_step(self, outputs: list[EngineOutput], aborted: list[str]) -> None:
        """Per-step observations (engine thread, right after the step). A choice's
        inter-token latency is the time between the steps that gave it tokens, one
        observation per step however many tokens it got (as vLLM counts under speculative
        decoding); tokens per step count the prompt of a choice at its first token."""
        now = self.clock()
        step_tokens = 0
        for out in outputs:
            choices = _completions(out)
            seqs = self.live.get(out.request_id)
            if seqs is None:
                seqs = self.live[out.request_id] = [[0, now] for _ in choices]
                m = out.metrics
                if m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                if not choices:  # an embedding: its one output comes with its whole prompt
                    step_tokens += len(out.prompt_token_ids)
            for seq, c in zip(seqs, choices, strict=False):
                n = len(c.token_ids)
                if n > seq[0]:
                    if seq[0] == 0:
                        step_tokens += len(out.prompt_token_ids)
                    else:
                        self.itl.observe(now - seq[1])
                        self.tpot.observe(now - seq[1])
                    step_tokens += n - int(seq[0])
                    seq[0], seq[1] = n, now
            if out.finished:
                del self.live[out.request_id]
                self.finished(out)
        for rid in aborted:  # gone without a finished output
            self.live.pop(rid, None)
        if step_tokens:
            self.iteration.observe(step_tokens)

    def finished(self, out: EngineOutput) -> None:
        """vLLM's finished-request histograms. Timings are the first choice's (the engine
        reports one RequestMetrics per request); token counts cover every choice."""
        self.success[request_finish_reason(out)].inc()
        generated = [len(c.token_ids) for c in _completions(out)]
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(generated))
        self.max_generation_tokens.observe(max(generated, default=0))
        self.prefill_kv_computed.observe(len(out.prompt_token_ids) - out.num_cached_tokens)
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if scheduled is None:
            return
        self.queue.observe(scheduled - m.arrival_time)
        if first is None or last is None:
            return
        decode = last - first
        self.prefill.observe(first - scheduled)
        self.decode.observe(decode)
        self.inference.observe(last - scheduled)
        num = generated[0] if generated else 0
        self.request_tpot.observe(decode / (num - 1) if num > 1 else 0.0)


class ServerMetrics:
    """Metrics of one server; register each engine with ``attach``."""

    def __init__(
        self, prefix: str = DEFAULT_PREFIX, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.prefix = check_prefix(prefix)
        self.clock = clock  # the engine's clock (RequestMetrics times); tests pass their own
        self.registry = CollectorRegistry(auto_describe=True)
        self._collector = _EngineStatsCollector(self.prefix)
        self.registry.register(self._collector)
        self._models: dict[str, _ModelMetrics] = {}
        self.histograms: dict[str, Histogram] = {}
        for key, name, doc, buckets in _HISTOGRAMS:
            self.histograms[key] = self._histogram(name, doc, buckets)
        self.success = Counter(
            f"{self.prefix}:request_success", "Count of successfully processed requests.",
            [*LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            f"{self.prefix}:{name}", doc, LABELS, buckets=buckets, registry=self.registry
        )

    def _add_token_histograms(self, max_model_len: int) -> None:
        """vLLM sizes its token-count buckets by max_model_len; several models share one
        family, so the first model's length sets them (longer counts land in +Inf)."""
        buckets = tuple(float(b) for b in build_1_2_5_buckets(max_model_len))
        for key, name, doc in _TOKEN_HISTOGRAMS:
            self.histograms[key] = self._histogram(name, doc, buckets)

    def attach(self, model_name: str, engine: AsyncLLMEngine) -> None:
        """Export ``engine`` under ``model_name``: its stats snapshot at scrape time, its
        cache configuration, and its per-step and finished-request observations."""
        if "prompt_tokens" not in self.histograms:
            self._add_token_histograms(engine.max_model_len)
        self._collector.engines[model_name] = engine.stats
        self._collector.cache_info[model_name] = cache_config_info(engine)
        self._collector.paths_info[model_name] = execution_paths_info(engine)
        model = self._models[model_name] = _ModelMetrics(self, model_name)
        engine.add_step_callback(model.on_step)

    def observe_params(self, model_name: str, params: SamplingParams, num_requests: int) -> None:
        """vLLM's request_params_* histograms, observed by the server at admission (the
        engine's outputs do not carry the parameters): one per engine request (prompt)."""
        model = self._models.get(model_name)
        if model is None:
            return
        for _ in range(num_requests):
            model.params_n.observe(params.n)
            if params.max_tokens:
                model.params_max_tokens.observe(params.max_tokens)

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for ``GET /metrics``."""
        return _generate_latest(self.registry), CONTENT_TYPE_LATEST


def cache_config_info(engine: AsyncLLMEngine) -> dict[str, str]:
    """vLLM's cache_config_info labels (CacheConfig's fields as strings, vLLM's names where
    they carry over: num_gpu_blocks is the device's block count, num_cpu_blocks swap's)."""
    cache, kv = engine.config.cache, engine.kv_info
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": str(engine.config.model.dtype).removeprefix("torch."),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "num_gpu_blocks": str(kv["num_blocks"]),
        "num_cpu_blocks": str(kv["num_swap_blocks"]),
        "swap_space_bytes": str(cache.swap_space),
        "engine": ENGINE_INDEX,
    }


def execution_paths_info(engine: AsyncLLMEngine) -> dict[str, str]:
    """``ExecutionPaths`` of rank 0 as labels (kvserve's own), so that a benchmark of a server
    records which paths it ran: tuples as ``0|1`` (one entry per OpenMP thread), flags as
    space-separated text."""
    labels: dict[str, str] = {}
    for key, value in engine.execution_paths.as_dict().items():
        if key == "kernel_cflags":
            labels[key] = " ".join(value)
        elif key == "thread_cores":
            labels[key] = "|".join(",".join(map(str, cores)) for cores in value)
        elif key in ("cpu_affinity", "cuda_graphs"):
            labels[key] = ",".join(map(str, value))
        else:
            labels[key] = str(value)
    labels["engine"] = ENGINE_INDEX
    return labels
