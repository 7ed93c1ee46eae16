"""Sweep: CSV and PNG outputs from hand-made points, the grid, server commands, and a whole
sweep driving fake servers started through --server-cmd-template."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib import image
from matplotlib.figure import Figure

from kvserve.bench import plots, sweep
from kvserve.bench.cli import main

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def _point(seqs: int, kv: str, rate: float | str, tput: float, preempt: int) -> dict:
    return {"max_num_seqs": seqs, "kv_cache_memory": kv, "kv_policy": "preempt",
            "preemption_mode": None, "request_rate": rate, "repeats": 1,
            "output_throughput": tput, "num_preemptions": preempt}  # fmt: skip


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _assert_png(path: Path) -> None:
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0


def test_csv_and_plots_from_hand_made_points(tmp_path: Path) -> None:
    points = [
        _point(s, kv, r, 10.0 * s + (r if r != "inf" else 50), s * 3)
        for s in (4, 8) for kv in ("64MiB", "128MiB") for r in (1.0, 2.0, "inf")
    ]  # fmt: skip
    points.append({"max_num_seqs": 16, "request_rate": None, "error": "server died"})
    plots.write_csv(points, tmp_path / "sweep.csv")
    rows = _read_csv(tmp_path / "sweep.csv")
    assert len(rows) == 13 and list(rows[0]) == list(plots.CSV_COLUMNS)
    assert rows[0]["output_throughput"] == "41.0" and rows[0]["preemption_mode"] == ""
    assert rows[2]["request_rate"] == "inf" and rows[-1]["error"] == "server died"
    written = plots.write_plots(points[:-1], tmp_path)
    assert [p.name for p in written] == [
        "throughput_vs_rate.png", "preemptions_vs_batch.png", "throughput_vs_kv_cache.png"
    ]  # fmt: skip
    for path in written:
        _assert_png(path)


def _axes() -> Any:
    return Figure(figsize=(7, 4.5)).subplots()


def _visible_ticks(ax: Any) -> list[float]:
    low, high = ax.get_ylim()
    return [float(t) for t in ax.get_yticks() if low <= t <= high]


def test_coinciding_lines_stay_distinguishable() -> None:
    # Two batch sizes with the same throughput at every rate: one line lies on the other.
    points = [_point(s, "64MiB", r, 20.0, 0) for s in (4, 8) for r in (1.0, 2.0, "inf")]
    ax = _axes()
    assert plots.draw_throughput_vs_rate(ax, points) == 6
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["max_num_seqs=4", "max_num_seqs=8"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "max_num_seqs=4", "max_num_seqs=8"
    ]  # fmt: skip
    assert len({line.get_marker() for line in lines}) == 2
    assert len({line.get_linestyle() for line in lines}) == 2
    assert all(line.get_markerfacecolor() == "none" for line in lines)  # hollow: both show
    assert list(lines[0].get_xdata()) == [1.0, 2.0, 3.0]  # inf right of the largest rate
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "inf"]
    low, high = ax.get_ylim()
    assert -1.0 < low <= 0.0 and high >= 20.0  # from 0, not zoomed in on one value


def test_preemption_plot_with_no_preemptions() -> None:
    points = [_point(s, "64MiB", r, 10.0, 0) for s in (2, 8) for r in (2.0, 8.0)]
    ax = _axes()
    assert plots.draw_preemptions_vs_batch(ax, points) == 4
    assert [line.get_label() for line in ax.get_lines()] == [
        "request_rate=2.0", "request_rate=8.0"
    ]  # fmt: skip
    assert list(ax.get_xticks()) == [2.0, 8.0]
    assert _visible_ticks(ax) == [0.0, 1.0]  # no negative or fractional preemptions
    assert "no preemptions at any point" in [t.get_text() for t in ax.texts]


def test_preemption_plot_integer_ticks() -> None:
    points = [_point(s, "64MiB", 1.0, 10.0, p) for s, p in ((2, 0), (4, 3), (8, 7))]
    ax = _axes()
    plots.draw_preemptions_vs_batch(ax, points)
    ticks = _visible_ticks(ax)
    assert ticks[0] == 0.0 and max(ticks) >= 6 and all(t == int(t) for t in ticks)
    assert len(ax.texts) == 0


def test_kv_plot_ticks_at_measured_sizes() -> None:
    one = [_point(s, "256MiB", r, 10.0 * s, 0) for s in (2, 8) for r in (2.0, 8.0)]
    ax = _axes()
    assert plots.draw_throughput_vs_kv(ax, one) == 4
    assert list(ax.get_xticks()) == [256.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["256"]
    assert any("one KV cache size" in t.get_text() for t in ax.texts)
    assert len(ax.get_lines()) == 4 and ax.get_xlabel() == "KV cache memory (MiB)"
    two = [_point(4, kv, 1.0, 10.0, 0) for kv in ("1GiB", "64MiB")]
    ax = _axes()
    plots.draw_throughput_vs_kv(ax, two)
    assert list(ax.get_xticks()) == [64.0, 1024.0] and len(ax.texts) == 0
    assert list(ax.get_lines()[0].get_xdata()) == [64.0, 1024.0]


def test_kv_cache_axis_units() -> None:
    assert plots.kv_cache_mib(["64MiB", "1GiB"]) == ([64.0, 1024.0], "KV cache memory (MiB)")
    assert plots.kv_cache_mib(["0.5", "0.9"])[0] == [0.5, 0.9]  # another engine's knob


def test_make_point_averages_repeats() -> None:
    runs = [{"output_throughput": 10.0, "num_preemptions": 2, "mean_ttft_ms": None},
            {"output_throughput": 14.0, "num_preemptions": 4, "mean_ttft_ms": 30.0}]  # fmt: skip
    point = sweep.make_point(sweep.EngineSetting(max_num_seqs=4), float("inf"), runs)
    assert point["output_throughput"] == 12.0 and point["output_throughput_std"] == 2.0
    assert point["num_preemptions"] == 3.0 and point["mean_ttft_ms"] == 30.0
    assert point["request_rate"] == "inf" and point["repeats"] == 2 and point["max_num_seqs"] == 4


def _sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_sweep_args(parser)
    return parser.parse_args(list(argv))


def test_grid_and_kvserve_server_command() -> None:
    args = _sweep_args(
        "--max-num-seqs", "4,8", "--kv-policy", "preempt,reserve", "--kv-cache-memory", "64MiB",
        "--server-extra-args", "--block-size 8",
    )  # fmt: skip
    grid = sweep.engine_grid(args)
    assert len(grid) == 4 and grid[1] == sweep.EngineSetting(4, "64MiB", "reserve", None)
    cmd = sweep.server_command(args, grid[1], 8123)
    assert cmd[:4] == [sys.executable, "-m", "kvserve.cli", "serve"]
    assert cmd[4:] == ["--host", "127.0.0.1", "--port", "8123", "--max-num-seqs", "4",
                       "--kv-cache-memory", "64MiB", "--kv-policy", "reserve",
                       "--block-size", "8"]  # fmt: skip
    with pytest.raises(ValueError):
        sweep.engine_grid(_sweep_args("--kv-policy", "sometimes"))


def test_template_command_needs_its_values() -> None:
    template = "vllm serve {model} --port {port} --max-num-seqs {max_num_seqs}"
    args = _sweep_args("--server-cmd-template", template, "--model", "org/m")
    setting = sweep.EngineSetting(max_num_seqs=16)
    assert sweep.server_command(args, setting, 9000) == [
        "vllm", "serve", "org/m", "--port", "9000", "--max-num-seqs", "16"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_num_seqs"):
        sweep.server_command(args, sweep.EngineSetting(), 9000)


def test_whole_sweep_with_fake_servers(tmp_path: Path, byte_tokenizer_dir: Path) -> None:
    template = (
        f"{sys.executable} {FAKE_SERVER} --port {{port}} --preemptions-per-request {{max_num_seqs}}"
    )
    code = main(
        ["sweep", "--server-cmd-template", template, "--max-num-seqs", "1,2",
         "--request-rates", "inf,40", "--repeat", "2", "--dataset-name", "random",
         "--random-input-len", "16", "--random-output-len", "3", "--num-prompts", "4",
         "--tokenizer", str(byte_tokenizer_dir), "--result-dir", str(tmp_path),
         "--server-timeout", "30", "--metrics-interval", "0.05"]
    )  # fmt: skip
    assert code == 0
    rows = _read_csv(tmp_path / "sweep.csv")
    assert [(r["max_num_seqs"], r["request_rate"]) for r in rows] == [
        ("1", "inf"), ("1", "40.0"), ("2", "inf"), ("2", "40.0")
    ]  # fmt: skip
    for row in rows:
        assert row["error"] == "" and row["repeats"] == "2" and row["completed"] == "4.0"
        # 4 requests per run, each counted max_num_seqs times by the fake server.
        assert float(row["num_preemptions"]) == 4 * int(row["max_num_seqs"])
    assert len(list(tmp_path.glob("point-*.json"))) == 4
    assert len(list(tmp_path.glob("server-*.log"))) == 2
    for name in ("throughput_vs_rate.png", "preemptions_vs_batch.png"):
        _assert_png(tmp_path / name)


def test_server_that_dies_is_reported_not_fatal(tmp_path: Path) -> None:
    template = f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}"
    args = _sweep_args("--server-cmd-template", template, "--server-timeout", "20")
    points = sweep.run_setting(args, sweep.EngineSetting(), [1.0], tmp_path, [], None)
    assert len(points) == 1 and "exited with 3" in points[0]["error"]
