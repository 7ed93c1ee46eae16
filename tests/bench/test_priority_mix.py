"""``bench serve --priority-mix``: exact shares in a seeded order, vLLM's ``priority`` field in
each body, per-class metrics; and against a real kvserve server that schedules by priority
one request at a time, the high-priority class is served before the rest."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.bench import priority, serve
from kvserve.bench.client import RequestRecord
from kvserve.bench.datasets import SampleRequest
from kvserve.cli import main
from tests.server.conftest import Server, start_server


def test_parse_and_assign_exact_shares() -> None:
    mix = priority.parse_priority_mix("0:0.25,1:0.75")
    assert mix == [(0, 0.25), (1, 0.75)]
    labels = priority.assign_priorities(mix, 10, seed=3)
    assert sorted(labels) == [0] * 3 + [1] * 7  # 2.5 -> 3 by the larger remainder (tie: first)
    assert labels == priority.assign_priorities(mix, 10, seed=3)  # seeded
    assert labels != priority.assign_priorities(mix, 10, seed=4)
    thirds = priority.assign_priorities(priority.parse_priority_mix("0:0.5,1:0.3,2:0.2"), 7, 0)
    assert sorted(thirds) == [0, 0, 0, 0, 1, 1, 2]  # 3.5, 2.1, 1.4 -> 4, 2, 1 (remainders)
    for bad in ("0:0.5", "0:0.5,0:0.5", "a:1", "0:1,1:0", "0-1"):
        with pytest.raises(ValueError, match="--priority-mix"):
            priority.parse_priority_mix(bad)


def test_by_priority_splits_the_metrics() -> None:
    def rec(ttft: float) -> RequestRecord:
        return RequestRecord(success=True, prompt_len=4, output_tokens=3, ttft=ttft,
                             itl=[0.1, 0.1], latency=ttft + 0.2)  # fmt: skip

    records = [rec(0.1), rec(2.0), rec(0.3), rec(4.0)]
    out = priority.by_priority(records, [0, 1, 0, 1], 10.0, [50.0, 99.0], None)
    assert set(out["by_priority"]) == {"0", "1"}
    assert (out["priority_0_completed"], out["priority_1_completed"]) == (2, 2)
    assert out["priority_0_median_ttft_ms"] == pytest.approx(200.0)
    assert out["priority_1_median_ttft_ms"] == pytest.approx(3000.0)
    assert out["by_priority"]["1"]["total_output_tokens"] == 6


def test_bodies_carry_the_priorities(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    args = parser.parse_args(
        ["--dataset-name", "random", "--num-prompts", "8", "--priority-mix", "0:0.25,1:0.75",
         "--random-input-len", "4", "--random-output-len", "2", "--tokenizer", "unused"]
    )  # fmt: skip
    assert serve.request_priorities(args, 8) == priority.assign_priorities(
        [(0, 0.25), (1, 0.75)], 8, args.seed
    )
    samples = [SampleRequest(f"p{i}", 2, 2) for i in range(8)]
    bodies = [i.extra_body or {} for i in serve.build_inputs(samples, args, "u", "m")]
    assert [b["priority"] for b in bodies] == serve.request_priorities(args, 8)
    args.priority_labels_only = True  # the FCFS baseline: same classes, no field sent
    bodies = [i.extra_body or {} for i in serve.build_inputs(samples, args, "u", "m")]
    assert all("priority" not in b for b in bodies)
    with pytest.raises(ValueError, match="give both"):
        serve.resolve_backend(parser.parse_args(["--priority-labels-only"]))
    with pytest.raises(ValueError, match="multi_turn"):
        serve.resolve_backend(parser.parse_args(
            ["--dataset-name", "multi_turn", "--priority-mix", "0:1"]
        ))  # fmt: skip


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "priority.log"
    srv = start_server(["--max-num-seqs", "1", "--scheduling-policy", "priority"], log)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_high_priority_requests_are_served_first(one_at_a_time: Server, tmp_path: Path) -> None:
    """8 requests at once, 2 of priority 0: the server runs one at a time, so after the first
    request (already running when the others arrive) both priority-0 requests run before any
    priority-1 one: their first tokens come before the 2nd-last priority-1 request's."""
    argv = ["bench", "serve", "--base-url", one_at_a_time.url, "--dataset-name", "random",
            "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "8",
            "--ignore-eos", "--priority-mix", "0:0.25,1:0.75", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", str(tmp_path),
            "--result-filename", "r.json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["priority_0_completed"], result["priority_1_completed"]) == (2, 6)
    labels = priority.assign_priorities([(0, 0.25), (1, 0.75)], 8, 0)
    ttfts = result["ttfts"]
    high = sorted(t for t, p in zip(ttfts, labels, strict=True) if p == 0)
    low = sorted(t for t, p in zip(ttfts, labels, strict=True) if p == 1)
    assert high[-1] < low[-2]  # at most one priority-1 request (the first served) went ahead
    assert result["priority_0_p99_ttft_ms"] < result["priority_1_p99_ttft_ms"]
