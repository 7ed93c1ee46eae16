"""``bench serve --lora-modules``: every named adapter gets an exact, seeded share of the
requests, each request's body names its adapter, and against a real kvserve server serving
two adapters, every request's text is its own adapter's greedy answer to its prompt (the
adapters and the base answer differently, so a request sent to the wrong one fails)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.bench import lora_mix, serve
from kvserve.bench.datasets import SampleRequest
from kvserve.cli import main
from tests.lora.utils import SPECS, make_adapter
from tests.server.conftest import TINY, Server, start_server, tiny_model_dir  # noqa: F401


def test_equal_seeded_shares() -> None:
    labels = lora_mix.assign_modules(["a", "b", "c", "d"], 10, seed=3)
    assert lora_mix.module_counts(sorted(labels)) == {"a": 3, "b": 3, "c": 2, "d": 2}
    assert labels == lora_mix.assign_modules(["a", "b", "c", "d"], 10, seed=3)  # seeded
    assert labels != lora_mix.assign_modules(["a", "b", "c", "d"], 10, seed=4)
    assert lora_mix.assign_modules(["x"], 3, seed=0) == ["x", "x", "x"]
    for bad in ([], ["a", "a"], ["a", " "]):
        with pytest.raises(ValueError, match="--lora-modules"):
            lora_mix.check_modules(bad)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser


def test_bodies_name_their_adapter() -> None:
    args = _parser().parse_args(
        ["--dataset-name", "random", "--num-prompts", "6", "--lora-modules", "x", "y", "z",
         "--random-input-len", "4", "--random-output-len", "2", "--tokenizer", "unused"]
    )  # fmt: skip
    samples = [SampleRequest(f"p{i}", 2, 2) for i in range(6)]
    models = [i.model for i in serve.build_inputs(samples, args, "u", "base")]
    assert models == lora_mix.assign_modules(["x", "y", "z"], 6, args.seed)
    assert sorted(models) == ["x", "x", "y", "y", "z", "z"]
    args.lora_modules = None  # without the flag every request names the served model
    assert {i.model for i in serve.build_inputs(samples, args, "u", "base")} == {"base"}
    with pytest.raises(ValueError, match="multi_turn"):
        serve.resolve_backend(
            _parser().parse_args(["--dataset-name", "multi_turn", "--lora-modules", "x"])
        )
    with pytest.raises(ValueError, match="distinct"):
        serve.resolve_backend(_parser().parse_args(["--lora-modules", "x", "x"]))


@pytest.fixture(scope="module")
def two_adapters(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("bench_adapters")
    a0 = make_adapter(tiny_model_dir, root / "a0", SPECS["all8"], seed=21)
    a1 = make_adapter(tiny_model_dir, root / "a1", SPECS["qv4"], seed=22)
    log = tmp_path_factory.mktemp("logs") / "lora_bench.log"
    srv = start_server(
        [str(tiny_model_dir), "--served-model-name", TINY, "--enable-lora", "--max-loras", "2",
         "--num-kv-blocks", "200", "--lora-modules", f"a0={a0}", f"a1={a1}"],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.mark.slow
def test_each_request_is_answered_by_its_adapter(
    two_adapters: Server,
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    argv = ["--base-url", two_adapters.url, "--dataset-name", "random", "--num-prompts", "6",
            "--random-input-len", "12", "--random-output-len", "6", "--ignore-eos",
            "--temperature", "0", "--lora-modules", "a0", "a1",
            "--max-concurrency", "3"]  # fmt: skip
    out = ["--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
           "--result-filename", "r.json"]  # fmt: skip
    assert main(["bench", "serve", *argv, *out]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6
    assert result["requests_by_lora_module"] == {"a0": 3, "a1": 3}
    labels = result["lora_module_per_request"]
    assert labels == lora_mix.assign_modules(["a0", "a1"], 6, 0)
    args = _parser().parse_args([*argv, "--tokenizer", str(tiny_model_dir)])
    samples, _ = serve.prepare(args)  # the same seeded prompts the run sent

    def greedy(model: str, prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{two_adapters.url}/v1/completions", json=body, timeout=60)
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]

    for sample, label, text in zip(samples, labels, result["generated_texts"], strict=True):
        answers = {m: greedy(m, sample.prompt) for m in (TINY, "a0", "a1")}
        assert len(set(answers.values())) == 3, answers  # the test can tell them apart
        assert text == answers[label]
