"""``benchmarks/prefix_caching.py`` without real engines: its report on made-up runs (exact
medians, ratios and verdicts), and its whole loop (start, warm up, alternate, stop) on fake
servers run as subprocesses, one with prefix-cache counters and one without."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks import prefix_caching
from benchmarks.peers import prefix_report

FAKE = str(Path(__file__).with_name("fake_server.py"))


def _run(engine: str, workload: str, repeat: int, ttft: float, tput: float, rate: float | None):
    result = {"median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "output_throughput": tput,
              "prefix_cache_hit_rate": rate, "failed": 0, "completed": 4}  # fmt: skip
    return prefix_report.run_record(result, engine, workload, repeat)


def _runs() -> list[dict[str, Any]]:
    on, off, vllm = "kvserve-cache", "kvserve-nocache", "vllm-cache"
    return [
        _run(on, "shared_prefix", 0, 100.0, 120.0, 0.75),
        _run(on, "shared_prefix", 1, 140.0, 100.0, 0.25),
        _run(off, "shared_prefix", 0, 700.0, 50.0, 0.0),
        _run(off, "shared_prefix", 1, 500.0, 70.0, 0.0),
        _run(vllm, "shared_prefix", 0, 300.0, 90.0, 0.85),
        _run(vllm, "shared_prefix", 1, 300.0, 110.0, 0.85),
        _run(on, "multi_turn", 0, 50.0, 80.0, 0.7),
        _run(vllm, "multi_turn", 0, 60.0, 80.0, 0.6),
        _run(on, "random", 0, 400.0, 97.5, 0.0),
        _run(off, "random", 0, 400.0, 100.0, 0.0),
    ]


def test_summary_medians_and_targets() -> None:
    rows = prefix_report.summarize(_runs())
    assert [(r["workload"], r["engine"]) for r in rows][:3] == [
        ("shared_prefix", "kvserve-cache"),
        ("shared_prefix", "kvserve-nocache"),
        ("shared_prefix", "vllm-cache"),
    ]
    on = rows[0]
    assert (on["median_ttft_ms"], on["output_throughput"], on["repeats"]) == (120.0, 110.0, 2)
    assert on["prefix_cache_hit_rate"] == 0.5 and on["p99_ttft_ms"] == 240.0
    assert on["median_ttft_ms_runs"] == [100.0, 140.0]
    targets = prefix_report.check_targets(rows)
    assert [t["met"] for t in targets] == [True, False, False, True]
    assert targets[0]["value"] == 600.0 / 120.0  # TTFT off / on: 5.0x, at the target
    assert targets[1]["value"] == 110.0 / 100.0  # 1.1x < 1.2x
    assert targets[2]["value"] == 1.0  # a tie is not "ahead of"
    assert targets[3]["value"] == 97.5 / 100.0 - 1.0  # -2.5%: within 3%
    table = prefix_report.markdown_table(rows, prefix_caching.LABELS)
    assert "| shared_prefix | kvserve, caching on | 120 | 240 | 110.0 | 50.0% | – | 0 |" in table
    assert "| random | kvserve, caching off | 400 | 800 | 100.0 | 0.0% | – | 0 |" in table
    md = prefix_report.markdown_targets(targets)
    assert "| shared_prefix | kvserve TTFT p50, caching off / on | 5.00x | >= 5x | yes |" in md
    assert (
        "| random | output throughput, kvserve caching on vs off | -2.5% | within 3% | yes |" in md
    )


def test_targets_without_vllm_are_not_applicable() -> None:
    rows = prefix_report.summarize([r for r in _runs() if r["engine"] != "vllm-cache"])
    assert [t["met"] for t in prefix_report.check_targets(rows)] == [True, None, None, True]


def _fake(key: str, *extra: str) -> prefix_caching.Engine:
    def cmd(port: int) -> list[str]:
        return [sys.executable, FAKE, "--port", str(port), "--delay", "0.005", *extra]

    return prefix_caching.Engine(key, cmd, env={"FAKE_ENGINE": key}, start_timeout_s=60)


def test_whole_loop_on_fake_servers(byte_tokenizer_dir: Path, tmp_path: Path) -> None:
    args = prefix_caching.build_parser().parse_args(
        ["--model", str(byte_tokenizer_dir), "--out-dir", str(tmp_path), "--repeats", "2",
         "--prefix-len", "40", "--question-len", "8", "--output-len", "3", "--num-prompts", "3",
         "--random-num-prompts", "2", "--mt-conversations", "2", "--mt-turns", "3",
         "--mt-system-len", "10", "--mt-user-len", "6", "--concurrency", "2"]
    )  # fmt: skip
    args.workloads = list(prefix_caching.WORKLOADS)
    engines = [
        _fake("kvserve-cache", "--cache-queries-per-request", "100", "--cache-hits-per-request",
              "90"),
        _fake("kvserve-nocache"),
        prefix_caching.Engine("vllm-cache", lambda port: [sys.executable, "-c", "exit(3)"]),
    ]  # fmt: skip
    doc = prefix_caching.run_engines(args, engines, {})
    runs = doc["runs"]
    assert len(runs) == 2 * 3 * 2  # repeats x workloads x the two engines that started
    order = [(r["repeat"], r["engine"]) for r in runs if r["workload"] == "random"]
    assert order == [(0, "kvserve-cache"), (0, "kvserve-nocache"),
                     (1, "kvserve-nocache"), (1, "kvserve-cache")]  # fmt: skip
    completed = {r["workload"]: r["completed"] for r in runs}
    assert completed == {"shared_prefix": 3, "multi_turn": 6, "random": 2}
    assert all(r["failed"] == 0 for r in runs)
    for r in runs:
        assert r["prefix_cache_hit_rate"] == (0.9 if r["engine"] == "kvserve-cache" else None)
    assert [len(r["turns"]) for r in runs if r["workload"] == "multi_turn"] == [3] * 4
    assert "exited with 3" in doc["engine_errors"]["vllm-cache"]
    assert doc["commands"]["kvserve-cache"].startswith("env FAKE_ENGINE=kvserve-cache ")
    assert [t["met"] for t in doc["targets"]][1:3] == [None, None]  # no vLLM rows
    text = prefix_caching.write_outputs(doc, tmp_path)
    assert "| multi_turn | kvserve, caching on |" in text and "vllm-cache did not run:" in text
    assert (tmp_path / "prefix_caching.json").exists()
    assert (tmp_path / "prefix_caching.md").read_text() == text
