"""Bad input raises a clear exception and leaves the engine usable."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.input_processor import InputProcessor
from tests.engine.utils import random_prompts

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    # 8 blocks of 16 = 128 tokens of KV; the tiny model's context is 512.
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8)


def good_output(llm: LLM) -> list[int]:
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GOOD, use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": []}, GOOD, "prompt is empty"),
        ({"prompt_token_ids": [3] * 600}, GOOD, "context is 512 tokens"),
        ({"prompt_token_ids": [3, 999]}, GOOD, "out of the vocabulary"),
        ({"prompt_token_ids": [3] * 100}, SamplingParams(max_tokens=50), "can never fit"),
        ({"prompt_token_ids": [3] * 130}, SamplingParams(max_tokens=None), "can never fit"),
        ({"nothing": 1}, GOOD, "needs 'prompt' or 'prompt_token_ids'"),
        ("text", GOOD, "no tokenizer"),
    ],
)
def test_bad_request_raises_and_engine_survives(
    llm: LLM, prompt: object, params: SamplingParams, message: str
) -> None:
    before = good_output(llm)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [4, 5]}, prompt], params, use_tqdm=False)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
    assert good_output(llm) == before
    assert llm.stats()["num_free_kv_blocks"] == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -1.0}, "temperature must be non-negative"),
        ({"n": 0}, "n must be at least 1"),
        ({"n": 4097}, "n must be at most 4096"),
        ({"n": 2**63}, "n must be at most 4096"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": ["."], "detokenize": False}, "stop strings need detokenize=True"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_max_tokens_capped_by_context(llm: LLM) -> None:
    prompt = random_prompts([100])[0]
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=None, ignore_eos=True, temperature=0),
        use_tqdm=False,
    )[0]
    # max_tokens=None runs until the KV cache (128 tokens) is full.
    assert len(out.outputs[0].token_ids) == 28
    assert out.outputs[0].finish_reason == "length"


def test_duplicate_request_id_rejected(llm: LLM) -> None:
    llm.engine.add_request("dup", {"prompt_token_ids": [3, 4]}, GOOD)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", {"prompt_token_ids": [3, 4]}, GOOD)
    llm.engine.abort_request("dup")
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["num_free_kv_blocks"] == 8


def test_abort_mid_run_frees_blocks(llm: LLM) -> None:
    llm.engine.add_request("x", {"prompt_token_ids": [3] * 40}, SamplingParams(max_tokens=30))
    llm.engine.step()
    assert llm.stats()["num_free_kv_blocks"] < 8
    llm.engine.abort_request("x")
    assert llm.stats()["num_free_kv_blocks"] == 8
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": True}, "n must be an integer"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"seed": 2**63}, "seed must be in"),
        ({"seed": 2**63 - 1, "n": 2}, "seed \\+ n - 1 must be at most"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be a list of non-negative integers"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
    ],
)
def test_sampling_params_reject_wrong_types(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_engine_checks_token_ids_against_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match="stop_token_ids: token id 256 is out of the vocabulary"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(stop_token_ids=[256]))
    with pytest.raises(ValueError, match="token id True is out of the vocabulary"):
        llm.generate({"prompt_token_ids": [5, True]}, GOOD)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate({"prompt_token_ids": [5]}, GOOD, priority=[1])
    # top_k above the vocabulary keeps every token, like no top_k; the largest int64 too.
    params = SamplingParams(temperature=1.0, top_k=2**63 - 1, seed=3, max_tokens=4)
    same = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    out = llm.generate({"prompt_token_ids": [5, 6]}, [params], use_tqdm=False)
    ref = llm.generate({"prompt_token_ids": [5, 6]}, [same], use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def counting_validate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``InputProcessor.validate`` calls (the one check a request gets)."""
    calls: list[int] = []
    real = InputProcessor.validate

    def counting(self: InputProcessor, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InputProcessor, "validate", counting)
    return calls


def test_each_request_is_validated_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM.generate checks every prompt before queueing any and the engine admits them as
    checked: one validation per prompt, and the caller's SamplingParams stay as given."""
    calls = counting_validate(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    before = dataclasses.asdict(params)
    llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}], params, use_tqdm=False)
    assert len(calls) == 2
    assert dataclasses.asdict(params) == before
