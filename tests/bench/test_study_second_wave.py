"""Experiment 7 (speculative decoding across request rates) for real, quick: three servers of
the built-in model (speculation off, n-gram, n-gram cut off above 2 running), grounded prompts;
the server's own spec_decode counters tell them apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.study import run
from benchmarks.study.second_wave import EXP7_QUICK, speculative_config

pytestmark = pytest.mark.slow


def test_speculative_config_carries_the_cut_off() -> None:
    assert json.loads(speculative_config(EXP7_QUICK, True)) == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_by_batch_size": 2,
    }  # fmt: skip
    assert "disable_by_batch_size" not in json.loads(speculative_config(EXP7_QUICK, False))


def test_exp7_quick_three_servers(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        argv = ["exp7", "--quick", "--out-dir", str(tmp_path / "out"),
                "--work-dir", str(tmp_path / "work")]  # fmt: skip
        assert run.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    by = {p["speculation"]: p for p in doc["points"]}
    assert list(by) == ["off", "ngram", "ngram, off above 2 running"]
    for p in by.values():
        assert p["completed"] == 4 and p["failed"] == 0 and p["request_rate"] == "inf"
        assert 4 <= p["total_output_tokens"] <= 4 * 16
        assert p["server_cpu_seconds"] > 0 and p["server_peak_rss_mib"] > 200
    assert not by["off"].get("spec_decode_num_drafts")  # no speculation, no drafts
    assert by["ngram"]["spec_decode_num_drafts"] > 0
    # greedy: the same answers whether or not drafts were verified
    assert by["ngram"]["total_output_tokens"] == by["off"]["total_output_tokens"]
    assert (tmp_path / "out" / "exp7.png").stat().st_size > 0


def test_exp8_quick_budget_moves_freed_weight_bytes_into_kv(tmp_path: Path) -> None:
    """bf16 with 16 KV blocks, then int8 with the same blocks and with bf16's weights + KV."""
    threads = torch.get_num_threads()
    try:
        assert run.main(["exp8", "--quick", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "results.json").read_text())
    w = doc["settings"]["weight_bytes"]
    assert w["int8"] < w["bf16"]
    bf16, same_kv, same_budget = doc["points"]
    assert [(p["quantization"], p["memory"]) for p in doc["points"]] == [
        ("bf16", "bf16"), ("int8", "same KV"), ("int8", "same budget")
    ]  # fmt: skip
    assert bf16["num_kv_blocks"] == same_kv["num_kv_blocks"] == 16
    block = bf16["kv_cache_mib"] / 16
    budget = doc["settings"]["budget_bytes"] / 2**20
    assert budget == pytest.approx(bf16["weights_mib"] + bf16["kv_cache_mib"])
    # the same budget: int8's KV takes what its weights freed, to within one block
    assert budget - block < same_budget["total_mib"] <= budget
    assert same_budget["num_kv_blocks"] > 16
    assert all(p["completed"] == 4 and p["failed"] == 0 for p in doc["points"])


def test_exp9_quick_priority_serves_the_urgent_class_first(tmp_path: Path) -> None:
    """One request at a time, 8 at once, 2 urgent: under the priority policy both urgent
    requests run right after the first one, so their tail TTFT is below the rest's."""
    threads = torch.get_num_threads()
    try:
        assert run.main(["exp9", "--quick", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "results.json").read_text())
    by = {p["scheduling_policy"]: p for p in doc["points"]}
    assert list(by) == ["fcfs", "priority"]
    for p in by.values():
        assert (p["priority_0_completed"], p["priority_1_completed"]) == (2, 6)
        assert p["completed"] == 8 and p["engine"] == "kvserve"
    urgent, rest = (
        by["priority"]["priority_0_p99_ttft_ms"],
        by["priority"]["priority_1_p99_ttft_ms"],
    )
    assert urgent < rest
