"""Sleep mode in the engine: greedy tokens are unchanged after waking from level 1 and 2,
requests are refused while asleep (or wake it after an idle sleep), the engine refuses to
sleep with requests unfinished, and the mode must be turned on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.sleep_mode import EngineSleepingError, SleepRefusedError
from tests.engine.utils import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 17])]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    engine = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, enable_sleep_mode=True)
    yield engine
    engine.engine.close()


def test_tokens_unchanged_after_each_level(llm: LLM) -> None:
    want = tokens(llm)
    runner = llm.engine.runner
    assert runner is not None
    for level in (1, 2):
        llm.sleep(level)
        assert llm.engine.is_sleeping and llm.engine.sleep_level == level
        assert runner.kv_caches == [] and (runner.model is None) == (level == 2)
        with pytest.raises(EngineSleepingError, match="wake_up"):
            tokens(llm)
        llm.wake_up()
        assert not llm.engine.is_sleeping
        assert tokens(llm) == want
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_refusals(llm: LLM, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"1 .* or 2"):
        llm.sleep(3)
    llm.engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(SleepRefusedError, match="1 request"):
        llm.sleep(1)
    llm.engine.abort_request("busy")
    llm.wake_up()  # awake already: nothing to do
    assert not llm.engine.is_sleeping


def test_sleep_mode_must_be_on(tiny_llama: Path) -> None:
    off = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            off.sleep(1)
    finally:
        off.engine.close()


def test_idle_sleep_wakes_on_the_next_request(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """What ``serve --sleep-idle-seconds`` runs: the async engine's idle loop sleeps the
    model, and the next request wakes it (logged) and gets the same tokens."""
    want = tokens(llm)[0]

    async def run() -> list[int]:
        engine = AsyncLLMEngine(llm.engine, sleep_idle_seconds=0.2)
        try:
            for _ in range(200):  # the idle sleep is due 0.2 s after start
                if engine.is_sleeping:
                    break
                await asyncio.sleep(0.05)
            assert engine.is_sleeping and llm.engine.wake_on_request
            out = None
            async for out in engine.generate(PROMPTS[0], GREEDY):  # noqa: B007 - the last
                pass
            assert out is not None and out.finished
            return out.outputs[0].token_ids
        finally:
            engine.shutdown()

    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert asyncio.run(run()) == want
    assert "woke from sleep level 1" in caplog.text
