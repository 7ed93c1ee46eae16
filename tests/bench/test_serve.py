"""``bench serve`` end to end against the fake streaming server (never a real kvserve one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.bench import serve
from kvserve.bench.cli import add_bench_parser, main
from kvserve.bench.report import format_summary

VLLM_KEYS = [
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_concurrent_requests",
    *[f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p99")],
]  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser.parse_args(list(argv))


async def test_benchmark_with_warmups_cap_and_server_metrics(
    fake_server, byte_tokenizer_dir: Path
) -> None:
    fake_server.preemptions_per_request = 2
    args = _args(
        "--base-url", fake_server.base_url, "--dataset-name", "chatterbot", "--num-prompts", "6",
        "--tokenizer", str(byte_tokenizer_dir), "--max-concurrency", "2", "--num-warmups", "2",
        "--goodput", "ttft:5000", "--percentiles", "50", "--disable-tqdm",
        "--metrics-interval", "0.05", "--save-detailed", "--api-key", "k",
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    result = await serve.benchmark(args, samples, tokenizer)
    assert len(fake_server.bodies) == 8  # 2 warm-ups were sent, but not counted:
    assert (result["completed"], result["failed"]) == (6, 0) and result["num_prompts"] == 6
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (42, 18)  # usage
    assert result["model_id"] == "fake-model"  # from /v1/models
    assert result["mean_ttft_ms"] >= 200.0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["max_concurrent_requests"] == 2
    assert result["server_metrics_source"] == "kvserve"
    assert result["num_preemptions"] == 12  # 6 measured requests x 2, warm-ups excluded
    assert result["peak_num_requests_running"] == 2
    for key in [*VLLM_KEYS, "p50_ttft_ms"]:
        assert key in result, key
    assert len(result["ttfts"]) == len(result["itls"]) == len(result["generated_texts"]) == 6
    assert set(result["output_token_sources"]) == {"usage"}
    assert result["settings"]["num_prompts"] == 6 and "api_key" not in result["settings"]
    body = fake_server.bodies[-1]
    assert "ignore_eos" not in body  # chatterbot generates until EOS by default
    summary = format_summary(result, ["ttft", "tpot", "itl", "e2el"])
    for line in ("Serving Benchmark Result", "Successful requests:", "P50 TTFT (ms):",
                 "Request goodput (req/s):", "Preemptions:"):  # fmt: skip
        assert line in summary


async def test_chat_backend_random_dataset_fixed_lengths(
    fake_server, byte_tokenizer_dir: Path
) -> None:
    fake_server.delays = [0.01, 0.01, 0.01]
    args = _args(
        "--base-url", fake_server.base_url, "--backend", "openai-chat", "--model", "my-model",
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "5",
        "--num-prompts", "3", "--tokenizer", str(byte_tokenizer_dir), "--request-rate", "50",
        "--disable-tqdm", "--no-server-metrics", "--temperature", "0", "--extra-body",
        '{"top_k": 3}',
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    result = await serve.benchmark(args, samples, tokenizer)
    assert result["completed"] == 3 and result["request_rate"] == 50.0
    assert result["server_metrics_source"] is None and result["num_preemptions"] is None
    for body in fake_server.bodies:
        assert body["model"] == "my-model" and body["ignore_eos"] is True
        assert body["max_completion_tokens"] == 5 and body["max_tokens"] == 5
        assert (body["temperature"], body["top_k"]) == (0.0, 3)
        assert len(body["messages"][0]["content"].encode()) == 32


def test_cli_serve_saves_vllm_shaped_json(threaded_fake_server, byte_tokenizer_dir, tmp_path):
    code = main(
        ["serve", "--base-url", threaded_fake_server.base_url, "--dataset-name", "random",
         "--random-input-len", "16", "--random-output-len", "3", "--num-prompts", "4",
         "--tokenizer", str(byte_tokenizer_dir), "--disable-tqdm", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "out.json",
         "--metadata", "gpu=none"]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["completed"] == 4 and saved["gpu"] == "none" and saved["request_rate"] == "inf"
    assert "ttfts" not in saved  # per-request lists only with --save-detailed
    for key in VLLM_KEYS:
        assert key in saved, key


def test_cli_serve_all_failed_exit_code(threaded_fake_server, byte_tokenizer_dir, capsys):
    threaded_fake_server.fail_status = 503
    code = main(
        ["serve", "--base-url", threaded_fake_server.base_url, "--dataset-name", "random",
         "--random-input-len", "8", "--num-prompts", "2", "--tokenizer", str(byte_tokenizer_dir),
         "--disable-tqdm"]
    )  # fmt: skip
    assert code == 1
    assert "Failed requests:                         2" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(byte_tokenizer_dir, capsys) -> None:
    argv = ["serve", "--tokenizer", str(byte_tokenizer_dir), "--goodput", "ttft=5"]
    assert main(argv) == 2
    assert "--goodput" in capsys.readouterr().err


def test_add_bench_parser_on_a_top_level_cli() -> None:
    parser = argparse.ArgumentParser(prog="kvserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(
        ["bench", "sweep", "--max-num-seqs", "4,8", "--request-rates", "1,inf"]
    )
    assert (args.command, args.bench_command) == ("bench", "sweep")
    assert (args.sweep_max_num_seqs, args.request_rates) == ("4,8", "1,inf")
    args = parser.parse_args(["bench", "throughput", "--max-num-seqs", "4"])
    assert args.max_num_seqs == 4 and args.bench_command == "throughput"


async def test_prefix_cache_hit_rate_and_cached_tokens(fake_server, byte_tokenizer_dir) -> None:
    # Every request: 110 prompt tokens looked up, 99 found; usage says 99 were cached.
    fake_server.delays = [0.01, 0.01, 0.01]
    fake_server.cache_queries_per_request, fake_server.cache_hits_per_request = 110, 99
    fake_server.cached_tokens = 99
    args = _args(
        "--base-url", fake_server.base_url, "--dataset-name", "prefix", "--prefix-len", "100",
        "--prefix-suffix-len", "10", "--prefix-num-groups", "1", "--prefix-output-len", "3",
        "--num-prompts", "6", "--num-warmups", "2", "--tokenizer", str(byte_tokenizer_dir),
        "--disable-tqdm", "--save-detailed",
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    result = await serve.benchmark(args, samples, tokenizer)
    assert len(fake_server.bodies) == 8 and result["completed"] == 6
    # The server's counters over the measured run only (warm-ups came before the first scrape).
    assert (result["prefix_cache_queries"], result["prefix_cache_hits"]) == (660, 594)
    assert result["prefix_cache_hit_rate"] == 0.9
    assert result["total_cached_tokens"] == 594 and result["cached_tokens"] == [99] * 6
    summary = format_summary(result)
    for label, shown in (
        ("Prefix cache hit rate (%):", "90.00"),
        ("Prefix cache hits (tokens):", "594"),
        ("Prefix cache queries (tokens):", "660"),
        ("Total cached prompt tokens:", "594"),
    ):
        assert f"{label:<40} {shown}" in summary, label


async def test_server_without_prefix_cache_metrics_gives_null(fake_server, byte_tokenizer_dir):
    fake_server.delays = [0.01, 0.01, 0.01]
    args = _args(
        "--base-url", fake_server.base_url, "--dataset-name", "random", "--num-prompts", "2",
        "--random-input-len", "8", "--tokenizer", str(byte_tokenizer_dir), "--disable-tqdm",
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    result = await serve.benchmark(args, samples, tokenizer)
    assert result["server_metrics_source"] == "kvserve"
    assert result["prefix_cache_queries"] is None and result["prefix_cache_hit_rate"] is None
    assert result["total_cached_tokens"] is None
    assert "Prefix cache" not in format_summary(result)
