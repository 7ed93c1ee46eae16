"""``kvserve bench sweep`` for real: the default command starts kvserve servers on the built-in
model, one per batch size, and benchmarks each at two request rates."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from matplotlib import image

from kvserve.cli import main

pytestmark = pytest.mark.slow

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 16, 4
PLOTS = ("throughput_vs_rate.png", "preemptions_vs_batch.png", "throughput_vs_kv_cache.png")


def test_sweep_two_rates_two_batch_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers inherit it (shared 2-core box)
    code = main(
        ["bench", "sweep", "--request-rates", "4,inf", "--max-num-seqs", "2,4",
         "--kv-cache-memory", "64MiB", "--server-extra-args", "--num-threads 1",
         "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
         "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
         "--metrics-interval", "0.2", "--server-timeout", "120", "--result-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0

    with open(tmp_path / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["request_rate"], r["max_num_seqs"]) for r in rows] == [
        ("4.0", "2"), ("inf", "2"), ("4.0", "4"), ("inf", "4")
    ]  # fmt: skip
    for row in rows:
        assert row["error"] == "" and row["repeats"] == "1", row
        assert (row["completed"], row["failed"]) == (f"{NUM_PROMPTS}.0", "0.0"), row
        assert row["kv_cache_memory"] == "64MiB" and row["num_preemptions"] == "0.0"
        assert 1 <= float(row["peak_num_requests_running"]) <= int(row["max_num_seqs"])
        assert float(row["output_throughput"]) > 0
        # the server's cost over the point (its warm-up included): a loaded model's memory
        assert float(row["server_cpu_seconds"]) > 0 and float(row["server_peak_rss_mib"]) > 200
        per_1k = 1000 * float(row["server_cpu_seconds"]) / (NUM_PROMPTS * OUTPUT_LEN)
        assert float(row["server_cpu_s_per_1k_output_tokens"]) == pytest.approx(per_1k)
        # The run behind the row: every prompt and answer had exactly the asked length.
        point = json.loads((tmp_path / row["result_file"]).read_text())
        (run,) = point["runs"]
        assert run["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
        assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert run["model_id"] == "SmolLM2-135M-Instruct" and run["ignore_eos"] is True

    assert len(list(tmp_path.glob("point-*.json"))) == 4
    logs = sorted(tmp_path.glob("server-*.log"))
    assert len(logs) == 2 and all("ready: http://127.0.0.1:" in p.read_text() for p in logs)
    for name in PLOTS:
        pixels = image.imread(tmp_path / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0, name
