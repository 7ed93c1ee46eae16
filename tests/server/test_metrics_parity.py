"""vLLM-compatible /metrics: vLLM's names and labels under ``--metrics-prefix``, request-level
counts (requests, not choices), per-step inter-token latency, and the Grafana dashboard in
docs/grafana naming only metrics a live server exports."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import CacheConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.server.metrics import ServerMetrics
from kvserve.worker.execution_paths import ExecutionPaths
from tests.server.conftest import TINY, Server, start_server

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "kvserve-dashboard.json"
# Every series vLLM's own Grafana dashboard queries
# (vllm-project/vllm examples/observability/prometheus_grafana/grafana.json), all filtered by
# model_name; request_success_total is summed by finished_reason.
VLLM_DASHBOARD_NAMES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]  # fmt: skip
# Names kvserve exported before and that tests, kvserve.bench and benchmarks read.
KVSERVE_NAMES = [
    "kvserve:num_requests_running", "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc", "kvserve:max_num_requests_running",
    "kvserve:num_preemptions_total", "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total", "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total", "kvserve:e2e_request_latency_seconds_count",
    "kvserve:time_to_first_token_seconds_count", "kvserve:engine_healthy",
]  # fmt: skip
Sample = tuple[str, dict[str, str], float]


def scrape(url: str) -> list[Sample]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def values(samples: list[Sample]) -> dict[str, float]:
    """TINY's samples by name (+ finished_reason), histogram buckets left out."""
    out = {}
    for name, labels, value in samples:
        if labels.get("model_name") == TINY and "le" not in labels:
            reason = labels.get("finished_reason")
            out[f"{name}{{{reason}}}" if reason else name] = value
    return out


def complete(srv: Server, **body: Any) -> dict[str, Any]:
    body = {"model": TINY, "prompt": "The sea is", "ignore_eos": True, **body}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _tiny_server(tiny_model_dir: Path, log: Path, *flags: str) -> Server:
    args = [str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "128", *flags]
    return start_server(args, log)


@pytest.fixture(scope="module")
def kv_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _tiny_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "kvserve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    srv = _tiny_server(tiny_model_dir, log, "--metrics-prefix", "vllm")
    yield srv
    srv.stop()


def dashboard_queries() -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template variables."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return found


@pytest.mark.slow
def test_every_dashboard_query_names_an_exported_metric(kv_server: Server) -> None:
    complete(kv_server, max_tokens=4)
    exported = {
        name for name, labels, _ in scrape(kv_server.url) if labels.get("model_name") == TINY
    }
    queries = dashboard_queries()
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(queries) >= len(panels) >= 12 and all(p["targets"] for p in panels)
    for query in queries:
        names = re.findall(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", query)
        assert names, f"no metric in {query!r}"
        missing = [n for n in names if n not in exported]
        assert not missing, f"{query!r} names metrics the server does not export: {missing}"
    referenced = {n for q in queries for n in re.findall(r"kvserve:[a-zA-Z0-9_]+", q)}
    for needed in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "request_time_per_output_token_seconds_bucket", "num_requests_waiting",
                   "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_hits_total",
                   "generation_tokens_total"):  # fmt: skip
        assert f"kvserve:{needed}" in referenced, needed
    assert set(KVSERVE_NAMES) <= exported  # the old names still work


@pytest.mark.slow
def test_vllm_prefix_scrape_has_the_names_vllms_dashboard_uses(vllm_server: Server) -> None:
    complete(vllm_server, max_tokens=4)
    samples = scrape(vllm_server.url)
    assert samples and all(name.startswith("vllm:") for name, _, _ in samples)
    ours = [(n, labels) for n, labels, _ in samples if labels.get("model_name") == TINY]
    names = {n for n, _ in ours}
    assert [n for n in VLLM_DASHBOARD_NAMES if n not in names] == []
    assert all(labels.get("engine") == "0" for _, labels in ours)  # vLLM's label set
    reasons = {labels["finished_reason"] for n, labels in ours if n == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}
    assert values(samples)["vllm:request_success_total{length}"] == 1


@pytest.mark.slow
def test_execution_paths_info_says_which_paths_and_cores_the_server_runs(
    kv_server: Server,
) -> None:
    """What benchmarks record of a server run (benchmarks/machine.py's server_run_paths):
    serve binds one thread per allowed core by default (--cpu-cores auto); in the engine's
    own process OpenMP thread 0 keeps the whole mask and threads 1.. are pinned."""
    import torch

    [labels] = [lb for n, lb, v in scrape(kv_server.url)
                if n == "kvserve:execution_paths_info" and v == 1.0]  # fmt: skip
    mask = sorted(os.sched_getaffinity(0))
    assert labels["model_name"] == TINY and labels["dtype"] == "float32"
    assert labels["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert labels["num_threads"] == str(len(mask))
    assert labels["cpu_affinity"] == ",".join(map(str, mask))
    assert labels["thread_cores"] == "|".join([",".join(map(str, mask)), *map(str, mask[1:])])
    assert labels["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


@pytest.mark.slow
def test_request_metrics_count_requests_not_choices(kv_server: Server) -> None:
    before = values(scrape(kv_server.url))
    usage = complete(kv_server, max_tokens=5, n=2, temperature=0.8, seed=3)["usage"]
    after = values(scrape(kv_server.url))

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = usage["prompt_tokens"]
    assert usage["completion_tokens"] == 10
    expected = {
        "kvserve:request_success_total{length}": 1,  # one request, though two choices
        "kvserve:request_generation_tokens_sum": 10,
        "kvserve:request_generation_tokens_count": 1,
        "kvserve:request_max_num_generation_tokens_sum": 5,
        "kvserve:request_prompt_tokens_sum": prompt,
        "kvserve:request_params_n_sum": 2,
        "kvserve:request_params_n_count": 1,
        "kvserve:request_params_max_tokens_sum": 5,
        "kvserve:time_to_first_token_seconds_count": 1,
        "kvserve:inter_token_latency_seconds_count": 2 * 4,  # per choice, per later token
        "kvserve:time_per_output_token_seconds_count": 2 * 4,
        "kvserve:request_time_per_output_token_seconds_count": 1,
        "kvserve:e2e_request_latency_seconds_count": 1,
        "kvserve:request_queue_time_seconds_count": 1,
        "kvserve:request_prefill_time_seconds_count": 1,
        "kvserve:request_decode_time_seconds_count": 1,
        "kvserve:request_inference_time_seconds_count": 1,
        "kvserve:generation_tokens_total": 10,
        # vLLM's tokens per step: each choice's prompt at its first token, then its tokens
        "kvserve:iteration_tokens_total_sum": 2 * prompt + 10,
        "kvserve:prompt_tokens_total": 2 * prompt,  # the engine admits each choice
    }
    assert {k: delta(k) for k in expected} == expected
    inference = delta("kvserve:request_inference_time_seconds_sum")
    parts = delta("kvserve:request_prefill_time_seconds_sum") + delta(
        "kvserve:request_decode_time_seconds_sum"
    )
    assert inference == pytest.approx(parts, abs=1e-9) and inference > 0


def fake_engine(callbacks: list[Any]) -> Any:
    """What ``ServerMetrics.attach`` reads of an AsyncLLMEngine."""
    return SimpleNamespace(
        config=SimpleNamespace(cache=CacheConfig(block_size=16), model=SimpleNamespace(dtype="x")),
        kv_info={"num_blocks": 10, "num_swap_blocks": 0},
        max_model_len=100,
        stats=lambda: {},
        add_step_callback=callbacks.append,
        execution_paths=ExecutionPaths(
            fused_ops=True, decode_loop=False, cpu_capability="AVX2", kernel_cflags=("-O3", "-x"),
            dtype="float32", weight_dtype="bfloat16", num_threads=2, cpu_affinity=(0, 1),
            thread_cores=((0,), (1,)), omp_wait_policy="PASSIVE", linears="packed-widened",
        ),
    )  # fmt: skip


def output(rid: str, tokens: list[list[int]], finished: bool = False) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.25)
    choices = [
        CompletionOutput(i, "", t, None, None, "length" if finished else None)
        for i, t in enumerate(tokens)
    ]
    return RequestOutput(rid, None, [7, 8, 9], choices, finished, metrics)


def test_inter_token_latency_is_per_step_and_aborts_leave_no_state() -> None:
    now = [1.0]
    metrics = ServerMetrics(clock=lambda: now[0])
    callbacks: list[Any] = []
    metrics.attach("m", fake_engine(callbacks))
    (on_step,) = callbacks
    paths = {"model_name": "m", "engine": "0", "fused_ops": "True", "decode_loop": "False",
             "cpu_capability": "AVX2", "kernel_cflags": "-O3 -x", "dtype": "float32",
             "weight_dtype": "bfloat16", "num_threads": "2", "cpu_affinity": "0,1",
             "thread_cores": "0|1", "omp_wait_policy": "PASSIVE", "cuda_graphs": "",
             "batch_invariant": "False", "linears": "packed-widened"}  # fmt: skip
    assert metrics.registry.get_sample_value("kvserve:execution_paths_info", paths) == 1.0

    def sample(name: str) -> float:
        value = metrics.registry.get_sample_value(f"kvserve:{name}", {"model_name": "m",
                                                                     "engine": "0"})  # fmt: skip
        return value or 0.0

    on_step([output("a", [[1]]), output("b", [[1], []])], [])
    assert sample("time_to_first_token_seconds_count") == 2
    assert sample("time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample("iteration_tokens_total_sum") == 3 + 1 + 3 + 1
    now[0] = 1.05  # "a" gets two tokens in one step (speculative decoding): one ITL
    on_step([output("a", [[1, 2, 3]]), output("b", [[1], [4]])], [])
    assert sample("inter_token_latency_seconds_count") == 1
    assert sample("inter_token_latency_seconds_sum") == pytest.approx(0.05)
    assert sample("iteration_tokens_total_sum") == 8 + 2 + 3 + 1  # b's 2nd choice: its prompt
    now[0] = 1.25
    on_step([output("b", [[1, 5], [4, 6]], finished=True)], ["a"])  # "a" aborted
    assert sample("inter_token_latency_seconds_count") == 3
    assert sample("inter_token_latency_seconds_sum") == pytest.approx(0.05 + 0.25 + 0.2)
    assert metrics.registry.get_sample_value(
        "kvserve:request_success_total",
        {"model_name": "m", "engine": "0", "finished_reason": "length"},
    ) == 1  # fmt: skip
    assert sample("request_generation_tokens_sum") == 4
    assert sample("request_max_num_generation_tokens_sum") == 2
    assert metrics._models["m"].live == {}  # finished and aborted requests are forgotten


def test_metrics_prefix_is_validated_and_server_only() -> None:
    with pytest.raises(ValueError, match="metrics_prefix"):
        EngineArgs(metrics_prefix="my-prefix")
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerMetrics("1st")
    with pytest.raises(ValueError, match="option of `kvserve serve`"):
        EngineArgs.from_kwargs(metrics_prefix="vllm")
    text = ServerMetrics("vllm").render()[0].decode()
    assert "# TYPE vllm:inter_token_latency_seconds histogram" in text
    assert "kvserve:" not in text


@pytest.mark.slow
def test_steps_by_batch_size_count_every_step_of_a_lone_request(kv_server: Server) -> None:
    """``kvserve:step_num_requests_running``: a lone request of 5 tokens runs 5 steps (its
    prompt's, then 4 decodes) of batch size 1, which the bench lab reads as its run's peak."""
    from kvserve.bench.server_metrics import histogram_floor, parse_samples

    name = "kvserve:step_num_requests_running"
    before = httpx.get(f"{kv_server.url}/metrics", timeout=10).text
    complete(kv_server, max_tokens=5)
    after = httpx.get(f"{kv_server.url}/metrics", timeout=10).text
    first, last = parse_samples(before), parse_samples(after)
    assert first is not None and last is not None
    delta = {k: last[k] - first.get(k, 0.0) for k in last if k.startswith(name)}
    assert delta[f"{name}_bucket{{1.0}}"] == delta[f"{name}_bucket{{inf}}"] == 5
    assert delta[f"{name}_count"] == delta[f"{name}_sum"] == 5
    assert histogram_floor(first, last, name) == 1
