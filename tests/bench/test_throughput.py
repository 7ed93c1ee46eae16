"""``bench throughput``: the accounting with a fake engine, and one light run of the real one."""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvserve.bench import throughput
from kvserve.bench.cli import main


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    prompt_token_ids: list[int]
    outputs: list[_Completion]


class FakeLLM:
    """Stands in for kvserve.LLM: one token per prompt byte, and every third request stops
    early (EOS) after 2 tokens, so totals must come from the outputs, not the dataset."""

    instances: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.preemptions = 0
        self.calls: list[int] = []
        FakeLLM.instances.append(self)

    def stats(self) -> dict[str, Any]:
        return {"num_preemptions": self.preemptions}

    def generate(self, prompts: list[str], params: list[Any], use_tqdm: bool = True) -> list:
        self.calls.append(len(prompts))
        self.preemptions += 3
        return [
            _Output(list(p.encode()), [_Completion([0] * (2 if i % 3 == 2 else sp.max_tokens))])
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_throughput_args(parser)
    return parser.parse_args(list(argv))


def test_throughput_counts_what_the_engine_returned(byte_tokenizer_dir: Path, tmp_path) -> None:
    out = tmp_path / "tp.json"
    args = _args(
        "--dataset-name", "random", "--random-input-len", "20", "--random-output-len", "6",
        "--num-prompts", "6", "--tokenizer", str(byte_tokenizer_dir), "--kv-cache-memory",
        "64MiB", "--max-num-seqs", "4", "--kv-policy", "reserve", "--num-warmups", "2",
        "--disable-tqdm", "--output-json", str(out),
    )  # fmt: skip
    result = throughput.run_throughput(args, llm_factory=FakeLLM)
    llm = FakeLLM.instances[-1]
    # The model and the options that differ from EngineArgs' defaults (seed 0 is the default).
    assert llm.kwargs == {"model": None, "kv_cache_memory": "64MiB",
                          "max_num_seqs": 4, "kv_policy": "reserve"}  # fmt: skip
    assert llm.calls == [2, 6]  # warm-up, then the timed call
    assert result["num_requests"] == 6
    assert result["total_prompt_tokens"] == 6 * 20
    assert result["total_output_tokens"] == 4 * 6 + 2 * 2  # two requests stopped early
    assert result["total_num_tokens"] == 120 + 28
    assert result["num_preemptions"] == 3  # the warm-up's are not counted
    assert result["output_tokens_per_second"] == pytest.approx(28 / result["elapsed_time"])
    assert result["requests_per_second"] == pytest.approx(6 / result["elapsed_time"])
    assert json.loads(out.read_text())["total_output_tokens"] == 28


def test_stats_without_preemptions_gives_none() -> None:
    class NoStats(FakeLLM):
        def stats(self) -> dict[str, Any]:
            return {}

    llm = NoStats()
    params = [type("P", (), {"max_tokens": 2})()]
    assert throughput.measure_generate(llm, ["ab"], params, False)["num_preemptions"] is None


@pytest.mark.slow
def test_real_engine_smoke(tmp_path: Path) -> None:
    if getattr(importlib.import_module("kvserve"), "LLM", None) is None:
        pytest.skip("kvserve.LLM is not in this build yet")
    out = tmp_path / "tp.json"
    argv = ["throughput", "--dataset-name", "random", "--random-input-len", "16",
            "--random-output-len", "4", "--num-prompts", "2", "--max-num-seqs", "2",
            "--disable-tqdm", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["total_output_tokens"] == 8  # ignore_eos
    assert result["num_preemptions"] == 0


def test_spec_decode_counters_are_run_deltas() -> None:
    class Speculating(FakeLLM):
        def stats(self) -> dict[str, Any]:
            n = len(self.calls)  # each call verifies 5 drafts of 4 tokens, 6 accepted
            return {"num_preemptions": 0, "spec_decode_num_drafts": 5 * n,
                    "spec_decode_num_draft_tokens": 20 * n,
                    "spec_decode_num_accepted_tokens": 6 * n}  # fmt: skip

    llm = Speculating()
    llm.generate(["x"], [type("P", (), {"max_tokens": 2})()])  # an earlier call: not counted
    result = throughput.measure_generate(llm, ["ab"], [type("P", (), {"max_tokens": 2})()], False)
    assert result["spec_decode_num_drafts"] == 5
    assert result["spec_decode_num_accepted_tokens"] == 6
    assert result["spec_decode_acceptance_rate"] == 6 / 20
    assert result["spec_decode_mean_acceptance_length"] == 1 + 6 / 5
