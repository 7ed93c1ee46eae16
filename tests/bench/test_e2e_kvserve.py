"""``kvserve bench serve`` end to end against a real ``kvserve serve`` on the built-in model.

The benchmark's token totals must agree with its own per-request records and, exactly, with
the server's Prometheus counters scraped around the run; warm-up requests must reach the
server but stay out of the benchmark's numbers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench import serve
from kvserve.cli import main
from tests.server.conftest import BUILTIN, Server, start_server

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 8
MAX_TOKENS = 24
PROMPT_TOTAL = "kvserve:prompt_tokens_total"
GENERATION_TOTAL = "kvserve:generation_tokens_total"
PREEMPTIONS_TOTAL = "kvserve:num_preemptions_total"
Metrics = dict[str, float]  # sample name -> value, as Server.metrics() returns


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in model with a small batch and KV cache; nothing else talks to it."""
    log = tmp_path_factory.mktemp("logs") / "bench_server.log"
    args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory", "256MiB"]
    srv = start_server(args, log)
    yield srv
    srv.stop()


def _chatterbot_argv(server: Server, out_dir: Path, *extra: str) -> list[str]:
    return [
        "--base-url", server.url, "--dataset-name", "chatterbot", "--seed", "0",
        "--max-tokens", str(MAX_TOKENS), "--disable-tqdm", "--metrics-interval", "0.2",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir),
        "--result-filename", "result.json", *extra,
    ]  # fmt: skip


def _dataset_prompt_lens(argv: list[str]) -> list[int]:
    """The prompts' token lengths by the benchmark's tokenizer, independently of the server."""
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    samples, _ = serve.prepare(parser.parse_args(argv))
    return [s.prompt_len for s in samples]


def _delta(before: Metrics, after: Metrics, name: str) -> int:
    value = after.get(name, 0.0) - before.get(name, 0.0)
    assert value == int(value), (name, value)
    return int(value)


def _finished(metrics: Metrics) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("kvserve:request_success_total"))


def _run(server: Server, argv: list[str], out_dir: Path) -> tuple[dict[str, Any], Metrics, Metrics]:
    """(saved result, server metrics before, after): the server idle on both sides."""
    before = server.wait_idle()
    assert main(["bench", "serve", *argv]) == 0
    after = server.wait_idle()  # also: every KV block was freed
    result = json.loads((out_dir / "result.json").read_text())
    return result, before, after


def test_poisson_chatterbot_totals_match_server_counters(
    bench_server: Server, tmp_path: Path
) -> None:
    n = 12
    argv = _chatterbot_argv(
        bench_server, tmp_path, "--num-prompts", str(n), "--request-rate", "8",
        "--num-warmups", "0",
    )  # fmt: skip
    result, before, after = _run(bench_server, argv, tmp_path)

    assert (result["completed"], result["failed"], result["num_prompts"]) == (n, 0, n)
    assert result["model_id"] == BUILTIN and result["request_rate"] == 8.0
    assert result["errors"] == [""] * n
    for key in serve.DETAILED_KEYS:
        assert len(result[key]) == n, key
    assert result["output_token_sources"] == ["usage"] * n

    # The totals are the sums of the per-request records...
    input_lens, output_lens = result["input_lens"], result["output_lens"]
    assert result["total_input_tokens"] == sum(input_lens)
    assert result["total_output_tokens"] == sum(output_lens)
    # ...the prompts are as long as the benchmark's tokenizer says (no tokens added)...
    assert input_lens == _dataset_prompt_lens(argv)
    assert all(1 <= k <= MAX_TOKENS for k in output_lens), output_lens
    # ...and the server counted exactly the same tokens and requests.
    assert _delta(before, after, PROMPT_TOTAL) == result["total_input_tokens"]
    assert _delta(before, after, GENERATION_TOTAL) == result["total_output_tokens"]
    assert _finished(after) - _finished(before) == n

    # Server metrics: scraped, no preemption in a 256 MiB cache, never more than the batch.
    assert result["server_metrics_source"] == "kvserve"
    assert "num_preemptions" in result and result["num_preemptions"] == 0
    assert _delta(before, after, PREEMPTIONS_TOTAL) == 0
    assert 1 <= result["peak_num_requests_running"] <= MAX_NUM_SEQS

    for ttft, e2e, itl, k in zip(
        result["ttfts"], result["latencies"], result["itls"], output_lens, strict=True
    ):
        assert 0 < ttft <= e2e
        assert len(itl) <= k - 1 and all(gap >= 0 for gap in itl)
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]


def test_warmups_reach_the_server_but_are_not_counted(bench_server: Server, tmp_path: Path) -> None:
    n, warmups = 4, 2
    argv = _chatterbot_argv(
        bench_server, tmp_path, "--num-prompts", str(n), "--num-warmups", str(warmups)
    )
    result, before, after = _run(bench_server, argv, tmp_path)

    assert (result["completed"], result["failed"], result["num_prompts"]) == (n, 0, n)
    assert len(result["input_lens"]) == n
    prompt_lens = _dataset_prompt_lens(argv)
    assert result["input_lens"] == prompt_lens
    # Warm-ups cycle over the dataset from its start: the server saw those prompts too.
    warm_prompts = sum(prompt_lens[i % n] for i in range(warmups))
    assert _delta(before, after, PROMPT_TOTAL) == result["total_input_tokens"] + warm_prompts
    warm_generated = _delta(before, after, GENERATION_TOTAL) - result["total_output_tokens"]
    assert warmups <= warm_generated <= warmups * MAX_TOKENS
    assert _finished(after) - _finished(before) == n + warmups
    assert result["num_preemptions"] == 0


def test_multi_turn_hit_rate_matches_usage_and_counters(
    bench_server: Server, tmp_path: Path
) -> None:
    argv = [
        "--base-url", bench_server.url, "--dataset-name", "multi_turn", "--seed", "7",
        "--multi-turn-num-conversations", "3", "--multi-turn-num-turns", "3",
        "--multi-turn-system-prompt-len", "64", "--multi-turn-user-len", "40",
        "--multi-turn-output-len", "8", "--max-concurrency", "2", "--temperature", "0",
        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "result.json",
    ]  # fmt: skip
    result, before, after = _run(bench_server, argv, tmp_path)
    assert (result["completed"], result["failed"], result["num_conversations"]) == (9, 0, 3)
    assert result["num_preemptions"] == 0  # so every request was admitted exactly once:
    # the server's counters over the run are the per-request usage fields, summed.
    queries = _delta(before, after, "kvserve:prefix_cache_queries_total")
    hits = _delta(before, after, "kvserve:prefix_cache_hits_total")
    assert (result["prefix_cache_queries"], result["prefix_cache_hits"]) == (queries, hits)
    assert queries == result["total_input_tokens"] == _delta(before, after, PROMPT_TOTAL)
    assert hits == result["total_cached_tokens"] == sum(result["cached_tokens"])
    assert result["prefix_cache_hit_rate"] == hits / queries
    # Later turns find the history (and the shared system prompt) in the cache.
    turns = result["turns"]
    assert [t["completed"] for t in turns] == [3, 3, 3]
    assert 0 < turns[0]["mean_cached_tokens"] < turns[1]["mean_cached_tokens"]
    assert turns[1]["mean_cached_tokens"] < turns[2]["mean_cached_tokens"]
    for i, turn in enumerate(result["turn_indices"]):
        if turn > 0:  # whole blocks of the previous turn's prompt, at least
            assert result["cached_tokens"][i] >= result["input_lens"][i - 1] // 16 * 16 - 16
