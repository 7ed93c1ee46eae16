"""How ``kvserve bench report`` reads its RUNs (no browser, no Bokeh): each of the lab's result
formats, the x axis and series it picks, names, the machine record, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.cli import main as bench_main
from kvserve.bench.report_html import machine_table, percentile_table, sections
from kvserve.bench.report_runs import factor_order, load_runs, natural_key

STUDY = Path(__file__).resolve().parents[2] / "docs" / "study"


def test_the_study_directory_gives_one_run_per_experiment_and_part() -> None:
    runs = load_runs([str(STUDY)])
    assert [r.name for r in runs] == [
        "exp1", "exp2", "exp3", "exp4", "exp5/kv", "exp5/batch", "exp6", "exp7", "exp8", "exp9",
        "exp10",
    ]  # fmt: skip
    shapes = {r.name: (r.x_key(), [s.label for s in r.series()]) for r in runs}
    assert shapes["exp1"] == (
        "request_rate",
        [f"exp1 engine={e} max_num_seqs={n}" for e in ("kvserve", "vllm") for n in (4, 8, 16, 32)],
    )
    assert shapes["exp2"] == ("max_num_seqs", ["exp2"])
    assert shapes["exp3"] == (
        "request_rate",
        ["exp3 engine=kvserve mode=engine", "exp3 engine=kvserve mode=server",
         "exp3 engine=vllm mode=server"],
    )  # fmt: skip
    # kv_policy and preemption_mode follow from policy: not repeated in the labels
    policies = ("preempt/recompute", "preempt/swap", "reserve")
    assert shapes["exp4"] == (
        "kv_cache_memory",
        [f"exp4 engine=kvserve mode={m} policy={p}" for m in ("engine", "server") for p in policies]
        + ["exp4 engine=vllm mode=server policy=preempt/recompute"],
    )
    assert shapes["exp5/batch"][0] == "max_num_seqs"
    assert shapes["exp6"][0] == "max_num_seqs" and len(shapes["exp6"][1]) == 4
    assert shapes["exp9"] == (
        "request_rate",
        [f"exp9 engine={e} scheduling_policy={p}" for p in ("fcfs", "priority")
         for e in ("kvserve", "vllm")],
    )  # fmt: skip
    assert shapes["exp10"] == (
        "request_rate",
        ["exp10 mode=engine serving_path=engine"]
        + [f"exp10 mode=server serving_path={p}" for p in ("http", "grpc", "ray")],
    )
    assert sum(len(r.points) for r in runs) == 24 + 9 + 18 + 28 + 18 + 20 + 12 + 5 + 16 + 16


def test_run_directories_sort_by_number() -> None:
    names = ["exp10", "exp2", "exp1", "a", "exp1b", "exp9"]
    assert sorted(names, key=natural_key) == ["a", "exp1", "exp1b", "exp2", "exp9", "exp10"]


def test_serve_and_throughput_results_and_names(tmp_path: Path) -> None:
    exp3 = json.loads((STUDY / "exp3" / "results.json").read_text())
    served = [p["runs"][0] for p in exp3["points"] if p["mode"] == "server"]
    (tmp_path / "a").mkdir()
    for r in served:
        (tmp_path / "a" / f"r{r['request_rate']}.json").write_text(json.dumps(r))
    offline = {
        "elapsed_time": 2.5,
        "num_requests": 8,
        "requests_per_second": 3.2,
        "tokens_per_second": 410.0,
        "output_tokens_per_second": 205.0,
    }
    (tmp_path / "t.json").write_text(json.dumps(offline))
    runs = load_runs([f"kvserve={tmp_path / 'a'}", str(tmp_path / "t.json")])
    assert [r.name for r in runs] == ["kvserve", "t"]
    assert runs[0].x_key() == "request_rate" and len(runs[0].points) == 6
    point = runs[1].points[0]  # bench throughput's names read as serve's
    assert (point.get("output_throughput"), point.get("request_throughput")) == (205.0, 3.2)
    assert point.source_key("output_throughput") == "output_tokens_per_second"
    assert runs[1].x_key() == "-"
    overlay = sections(runs, separate=False)
    assert [(s.x_key, len(s.series)) for s in overlay] == [("request_rate", 1), ("-", 1)]
    assert percentile_table(overlay[0]).count("<tr><th>kvserve</th>") == 6


def test_x_values_sort_by_size_then_inf() -> None:
    values = ["inf", "160MiB", "20MiB", "1GiB", "4", "32", "2.5", "engine"]
    assert sorted(values, key=factor_order) == [
        "2.5",
        "4",
        "32",
        "20MiB",
        "160MiB",
        "1GiB",
        "inf",
        "engine",
    ]


def test_machine_record_shows_roofline_in_units(tmp_path: Path) -> None:
    doc = {
        "output_throughput": 10.0,
        "request_rate": 1.0,
        "machine": {"cpu": "AMD EPYC", "cpu_paths": {"isa": ["avx2", "fma"]}},
        "roofline": {"bandwidth_bytes_s": 44952553767.97, "bf16_matmul_flop_s": 9.469e11},
    }
    (tmp_path / "r.json").write_text(json.dumps(doc))
    table = machine_table(load_runs([str(tmp_path / "r.json")]))
    for cell in (
        "<td>AMD EPYC</td>",
        "<td>avx2, fma</td>",
        "<td>45.0 GB/s</td>",
        "<td>0.947 TFLOP/s</td>",
        "machine.cpu_paths.isa",
    ):
        assert cell in table


def test_bad_runs_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a bench result"):
        load_runs([str(tmp_path / "x.json")])
    out = str(tmp_path / "r.html")
    assert bench_main(["report", str(tmp_path / "missing"), "-o", out]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert bench_main(["report", str(tmp_path / "empty"), "-o", out]) == 2
    assert "no bench results" in capsys.readouterr().err
