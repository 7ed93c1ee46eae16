"""``benchmarks/decode_ab.py``: settings, the per-repeat ratios on made-up times, and one
whole run of two settings on a tiny Llama in this process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import decode_ab
from tests.engine.utils import make_tiny_model


def test_settings() -> None:
    assert decode_ab.parse_settings("bf16, int4-lmhead,bf16") == ["bf16", "int4-lmhead"]
    with pytest.raises(argparse.ArgumentTypeError, match="int3"):
        decode_ab.parse_settings("bf16,int3")
    assert decode_ab.SETTINGS["int4-lmhead-eager"] == {
        "quantization": "int4", "quantization_lm_head": True, "enforce_eager": True,
    }  # fmt: skip


def test_ratios_are_taken_within_a_repeat() -> None:
    """bf16 slows down in repeat 2 and int4 with it: the per-repeat ratios (2, 4, 3) have
    median 3, where the ratio of the medians would say 20 / 5 = 4."""
    times = {"bf16": [10.0, 20.0, 30.0], "int4": [5.0, 5.0, 10.0]}
    summary = decode_ab.summarize(times)
    assert summary == {"median_ms": {"bf16": 20.0, "int4": 5.0}, "baseline": "bf16",
                       "speedup": {"int4": 3.0}}  # fmt: skip
    assert decode_ab.markdown(summary).splitlines()[2:] == ["| bf16 | 20.00 | - |",
                                                            "| int4 | 5.00 | 3.00 |"]  # fmt: skip


def test_a_run_on_a_tiny_llama(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path / "m")
    out = tmp_path / "ab.json"
    argv = ["--model", str(tmp_path / "m"), "--settings", "bf16,int8", "--repeats", "3",
            "--tokens", "2", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert decode_ab.main(argv) == 0
    record = json.loads(out.read_text())
    assert [len(v) for v in record["times_ms"].values()] == [3, 3]
    assert set(record["summary"]["speedup"]) == {"int8"}
    assert record["machine"]["cores"] >= 1
    assert "avx2" in record["machine"]["cpu_paths"]["isa"]  # every CI CPU kind has it


def test_float32_settings_take_their_dtype(tmp_path: Path) -> None:
    """fp32 settings run float32 compute, with the weights in float32 or stored in bf16."""
    make_tiny_model("llama", tmp_path / "m")
    out = tmp_path / "ab.json"
    argv = ["--model", str(tmp_path / "m"), "--settings", "fp32,fp32-bf16w", "--repeats", "1",
            "--tokens", "2", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert decode_ab.main(argv) == 0
    assert json.loads(out.read_text())["summary"]["baseline"] == "fp32"
    assert decode_ab.SETTINGS["fp32-bf16w"] == {"dtype": "float32", "weight_dtype": "bfloat16"}
