"""Experiment 10 (one engine, four ways in) for real, quick: the built-in model in process,
behind ``kvserve serve`` over HTTP and over gRPC, and behind ``kvserve serve --ray`` (a local
Ray started by the server itself). Greedy with ``ignore_eos``: every path must make exactly
the tokens the samples ask for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.study.serving_paths import EXP10_QUICK, completion_requests, path_flags
from benchmarks.study.workloads import chatterbot_samples
from kvserve.bench.datasets import SampleRequest

pytestmark = pytest.mark.slow


def test_path_flags() -> None:
    assert path_flags("http", 7) == (["--backend", "openai"], "")
    assert path_flags("grpc", 7) == (["--backend", "grpc", "--grpc-port", "7"], "--grpc-port 7")
    assert path_flags("ray", 7) == (["--backend", "openai"], "--ray")
    with pytest.raises(ValueError, match="unknown serving path 'h2'"):
        path_flags("h2", 7)


def test_completion_requests_are_greedy_and_exact() -> None:
    s = SampleRequest(prompt="Hi there", prompt_len=2, expected_output_len=5)
    (req,) = completion_requests([s])
    assert req.prompt == "Hi there" and req.expected_output_len == 5
    p = req.params
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 5, True)


def test_exp10_quick_four_paths(
    tmp_path: Path, builtin_model_dir: Path, run_study: Callable[..., dict[str, Any]]
) -> None:
    pytest.importorskip("ray.serve")
    from transformers import AutoTokenizer

    doc = run_study("exp10")
    by = {p["serving_path"]: p for p in doc["points"]}
    assert list(by) == ["engine", "http", "grpc", "ray"]  # the table's order

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_dir)
    samples = chatterbot_samples(tokenizer, EXP10_QUICK.num_prompts, 0, EXP10_QUICK.max_output_len)
    expected = sum(s.expected_output_len for s in samples)
    assert expected > EXP10_QUICK.num_prompts  # some answers are longer than one token
    for path, p in by.items():
        assert (p["completed"], p["failed"]) == (6, 0), path
        assert p["total_output_tokens"] == expected, path  # ignore_eos: exactly these
        assert p["num_kv_blocks"] == 64 and p["request_rate"] == "inf"
        assert p["server_cpu_seconds"] > 0, path
    assert by["engine"]["engine_threads"] == 1
    # the lab really spoke gRPC to the gRPC server and HTTP to the others
    assert doc["settings"]["server_flags"] == {
        "http": "", "grpc": "--grpc-port {grpc_port}", "ray": "--ray",
    }  # fmt: skip
    logs = {p: next((tmp_path / "work").glob(f"exp10-{p}-0/server-*.log")).read_text()
            for p in ("http", "grpc", "ray")}  # fmt: skip
    assert "gRPC: 127.0.0.1:" in logs["grpc"] and "gRPC: " not in logs["http"]
    assert "deploying kvserve on Ray" in logs["ray"]
    # Ray's raylet, GCS and actors are in the server's session: counted in its memory
    assert by["ray"]["server_peak_rss_mib"] > by["http"]["server_peak_rss_mib"] + 100
    assert (tmp_path / "out" / "exp10.png").stat().st_size > 0
    assert (tmp_path / "out" / "table.md").read_text().startswith("| rate req/s | path |")
