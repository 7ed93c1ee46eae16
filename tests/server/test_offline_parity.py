"""Greedy output over HTTP is exactly what the offline ``LLM`` generates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.server.conftest import BUILTIN, SERVER_THREADS, Server

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]


@pytest.fixture(scope="module")
def offline(builtin_model_dir: Path) -> Iterator[LLM]:
    # Same thread count as the servers, so even the float reduction order matches.
    threads = torch.get_num_threads()
    torch.set_num_threads(int(SERVER_THREADS))
    try:
        yield LLM(str(builtin_model_dir), num_kv_blocks=64)
    finally:
        torch.set_num_threads(threads)


def test_greedy_completion_matches_offline(server: Server, offline: LLM) -> None:
    client = server.client()
    params = SamplingParams(temperature=0, max_tokens=20)
    for prompt in PROMPTS:
        (ref,) = offline.generate(prompt, params, use_tqdm=False)
        r = client.completions.create(
            model=BUILTIN, prompt=prompt, max_tokens=20, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.model_extra["prompt_token_ids"] == ref.prompt_token_ids
        assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason


def test_greedy_chat_matches_offline(server: Server, offline: LLM) -> None:
    messages = [{"role": "user", "content": "What is the tallest mountain?"}]
    (ref,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    r = server.client().chat.completions.create(
        model=BUILTIN, messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert r.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert r.choices[0].message.content == ref.outputs[0].text
