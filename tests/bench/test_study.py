"""The study's pieces that can be checked without long runs: the in-process arrival driver on a
tiny random model (exact counts and token totals, rejected requests, preemptions), and the
``--quick`` path of two experiments writing their JSON/CSV/table/PNG."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks.study import run
from benchmarks.study.driver import DriverRequest, result_dict, run_arrivals, warm_up
from kvserve.bench.arrivals import arrival_times
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path)
    return path


def _engine(path: Path, **kwargs: object) -> LLMEngine:
    return LLMEngine(build_engine_config(str(path), dtype="float32", **kwargs))  # type: ignore[arg-type]


def test_driver_exact_counts_and_timings(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, num_kv_blocks=64, max_num_seqs=4)
    lens_in, lens_out = [5, 9, 17, 3, 12, 8], [4, 1, 7, 10, 2, 6]
    reqs = [
        DriverRequest(
            {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), m
        )
        for p, m in zip(random_prompts(lens_in), lens_out, strict=True)
    ]
    warm_up(engine, reqs[0].prompt, n=2)
    offsets = arrival_times(len(reqs), 200.0, seed=3, normalize=True)
    result = run_arrivals(engine, reqs, offsets)
    metrics = result.metrics()
    assert metrics.completed == 6 and metrics.failed == 0
    assert metrics.total_input_tokens == sum(lens_in)
    assert metrics.total_output_tokens == sum(lens_out)
    assert [r.output_tokens for r in result.records] == lens_out
    assert [r.prompt_len for r in result.records] == lens_in
    start = result.records[0].start_time
    for rec, off, n in zip(result.records, offsets, lens_out, strict=True):
        assert rec.start_time == pytest.approx(start + off)
        assert 0 < rec.ttft <= rec.latency <= result.duration
        assert len(rec.itl) == n - 1 and rec.finish_reason == "length"
    assert result.num_preemptions == 0 and not engine.has_unfinished_requests()
    assert result.peak_num_running <= 4
    d = result_dict(result)
    assert d["output_lens"] == lens_out and d["completed"] == 6
    assert d["output_throughput"] == pytest.approx(sum(lens_out) / result.duration)


def test_driver_preempts_and_rejects(tiny_dir: Path) -> None:
    # 4 blocks of 16 tokens: each request needs 2 blocks at the end, so 4 running must preempt.
    engine = _engine(tiny_dir, num_kv_blocks=4, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reqs = [DriverRequest({"prompt_token_ids": p}, params, 16) for p in random_prompts([10] * 4)]
    too_long = SamplingParams(max_tokens=100, ignore_eos=True)  # 110 tokens > 64 of KV
    reqs.append(DriverRequest({"prompt_token_ids": random_prompts([10])[0]}, too_long, 100))
    result = run_arrivals(engine, reqs, [0.0] * len(reqs))
    metrics = result.metrics()
    assert metrics.completed == 4 and metrics.failed == 1
    assert metrics.total_output_tokens == 64 and metrics.total_input_tokens == 40
    assert "never" in result.records[-1].error and not result.records[-1].success
    assert result.num_preemptions > 0
    with pytest.raises(ValueError, match="arrival offsets"):
        run_arrivals(engine, reqs, [0.0])


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_quick_experiments_write_results(
    tiny_dir: Path, tmp_path: Path, keep_torch_threads: None
) -> None:
    out2, out5 = tmp_path / "exp2", tmp_path / "exp5"
    assert run.main(["exp2", "--quick", "--model", str(tiny_dir), "--out-dir", str(out2)]) == 0
    rows = _rows(out2 / "exp2.csv")
    assert [r["max_num_seqs"] for r in rows] == ["2", "8"]
    assert all(r["completed"] == "6" and r["total_output_tokens"] == "96" for r in rows)
    assert rows[0]["num_preemptions"] == "0"  # 2 requests of 2 blocks fit 4 blocks
    doc = json.loads((out2 / "results.json").read_text())
    assert doc["quick"] is True and doc["settings"]["config"]["kv_cache"] == "4blocks"
    assert [p["num_kv_blocks"] for p in doc["points"]] == [4, 4]
    # the engine runs run.py's --num-threads (default 1), not every core it may bind
    assert [p["engine_threads"] for p in doc["points"]] == [1, 1]
    assert (out2 / "exp2.png").stat().st_size > 0
    assert (out2 / "table.md").read_text().startswith("| max_num_seqs |")

    assert run.main(["exp5", "--quick", "--model", str(tiny_dir), "--out-dir", str(out5)]) == 0
    rows = _rows(out5 / "exp5.csv")
    kv = [r for r in rows if r["part"] == "kv"]
    assert [(r["num_kv_blocks"], r["kv_policy"], r["preemption_mode"]) for r in kv] == [
        (b, pol, mode)
        for b in ("4", "16")
        for pol, mode in (("preempt", "recompute"), ("preempt", "swap"), ("reserve", ""))
    ]
    assert [r["max_num_seqs"] for r in rows if r["part"] == "batch"] == ["2", "8"]
    assert all(r["completed"] == "6" for r in rows)
    assert all(0 < int(r["total_output_tokens"]) <= 6 * 16 for r in kv)  # EOS or the cap
    assert all(r["num_preemptions"] == "0" for r in kv if r["kv_policy"] == "reserve")
    doc = json.loads((out5 / "results.json").read_text())
    assert doc["settings"]["model_size"]["vocab_size"] == 256
    assert len(doc["points"]) == 8


def test_quick_finding1_counts_what_preemption_recomputes(
    tiny_dir: Path, tmp_path: Path, keep_torch_threads: None
) -> None:
    """Experiment 6: a KV cache for exactly 2 whole requests. At max_num_seqs 2 nothing is
    preempted and every prompt token is computed once; at 6 the victims' prompts are computed
    again (caching off: at least a whole prompt per preemption)."""
    out = tmp_path / "exp6"
    argv = ["exp6", "--quick", "--model", str(tiny_dir), "--out-dir", str(out)]
    assert run.main([*argv, "--repeats", "2"]) == 0
    doc = json.loads((out / "results.json").read_text())
    points = doc["points"]
    assert [(p["input_len"], p["prefix_caching"], p["max_num_seqs"]) for p in points] == [
        (n, c, b) for n in (16, 40) for c in (True, False) for b in (2, 6)
    ]
    for p in points:
        assert p["repeats"] == 2 and len(p["repeat_values"]["output_throughput"]) == 2
        assert p["completed"] == 6 and p["total_output_tokens"] == 6 * 40
        assert p["num_kv_blocks"] == (8 if p["input_len"] == 16 else 10)  # 2 x (4 or 5)
        assert p["total_input_tokens"] == 6 * p["input_len"]
        if p["max_num_seqs"] == 2:  # each prompt computed exactly once
            assert (p["num_preemptions"], p["recomputed_tokens"]) == (0, 0)
            assert p["prefill_tokens_computed"] == 6 * p["input_len"]
        elif not p["prefix_caching"]:
            assert p["num_preemptions"] > 0 and p["prefix_cache_hit_tokens"] == 0
            assert p["recomputed_tokens"] >= p["num_preemptions"] * p["input_len"]
    assert (out / "exp6.png").stat().st_size > 0
    assert (out / "table.md").read_text().startswith("| prompt | prefix caching |")
