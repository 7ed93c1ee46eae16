"""Prefix caching end to end: greedy outputs are identical with caching on and off, hits are
counted in tokens, and forced preemption over cached blocks changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from tests.engine.conftest import TinyModels
from tests.engine.utils import random_prompts, run_engine_checked

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SYSTEM = random_prompts([37], seed=9)[0]  # a shared "system prompt": 9 blocks of 4 and a bit
TAILS = random_prompts([5, 11, 1, 8, 3], seed=10)
SHARED = [SYSTEM + t for t in TAILS]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_outputs_identical_on_and_off(tiny_models: TinyModels, arch: str) -> None:
    path = str(tiny_models[arch][0])
    off = LLM(path, dtype="float32", block_size=4, num_kv_blocks=200, enable_prefix_caching=False)
    on = LLM(path, dtype="float32", block_size=4, num_kv_blocks=200)
    expected = generate(off, SHARED)
    first = generate(on, SHARED[:1])
    assert first == expected[:1]
    # The rest share the first one's 9 system-prompt blocks, running or freed.
    assert generate(on, SHARED) == expected
    stats = on.stats()
    assert stats["prefix_cache_hits"] >= 9 * 4 * len(SHARED)
    assert off.stats()["prefix_cache_hits"] == 0


def test_multi_turn_reuses_the_answer(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=200)
    off = LLM(
        str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=200,
        enable_prefix_caching=False,
    )  # fmt: skip
    conversation = list(SYSTEM)
    computed = 0  # tokens of the conversation whose K/V the engine computed so far
    for turn in TAILS[:3]:
        conversation += turn
        prompt = {"prompt_token_ids": list(conversation)}
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        (ref,) = off.generate(prompt, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ref.num_cached_tokens == 0
        # The earlier turns and answers, in whole blocks (the last answer token was sampled,
        # never fed back, so it was not computed).
        assert out.num_cached_tokens == (computed // 4) * 4
        conversation += out.outputs[0].token_ids
        computed = len(conversation) - 1


@pytest.mark.parametrize(
    ("policy", "mode"), [("preempt", "recompute"), ("preempt", "swap"), ("reserve", "recompute")]
)
def test_forced_preemption_over_cached_blocks(tiny_llama: Path, policy: str, mode: str) -> None:
    prompts = SHARED + random_prompts([3, 20, 9], seed=2)
    roomy = LLMEngine(build_engine_config(
        str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=400,
        enable_prefix_caching=False,
    ))  # fmt: skip
    expected = run_engine_checked(roomy, prompts, GREEDY)
    tight = LLMEngine(build_engine_config(
        str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=40,
        kv_policy=policy, preemption_mode=mode,
    ))  # fmt: skip
    assert run_engine_checked(tight, prompts, GREEDY) == expected
    stats = tight.stats()
    assert stats["prefix_cache_hits"] > 0
    assert (stats["num_preemptions"] > 0) == (policy == "preempt")
    assert stats["num_free_kv_blocks"] == 40


def test_reset_prefix_cache(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=200)
    generate(llm, SHARED[:1])
    assert llm.reset_prefix_cache() > 0
    (out,) = llm.generate({"prompt_token_ids": SHARED[1]}, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0
