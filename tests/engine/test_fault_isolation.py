"""A fault inside a step stays with the request whose data caused it.

Faults are injected the only way left after the door's checks: by changing a request's data
after it was admitted (``Request.params`` and ``Request.all_token_ids`` are the live objects the
runner reads). The sampler and the model then fail for real, on real tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.request import Request
from kvserve.engine.fault_isolation import EngineFaultError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from tests.engine.utils import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
PROMPTS = random_prompts([9, 17, 5, 30])
Breaker = Callable[[Request], None]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, block_size=4)


def fresh(p: SamplingParams, **changes: object) -> SamplingParams:
    """A private copy: the breakers mutate a request's params in place."""
    return dataclasses.replace(p, **changes)  # type: ignore[arg-type]


def alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    out = llm.generate({"prompt_token_ids": prompt}, fresh(params), use_tqdm=False)
    return out[0].outputs[0].token_ids


def run(engine: LLMEngine, break_at: dict[str, int], breaker: Breaker) -> dict[str, RequestOutput]:
    """Step to the end, checking KV integrity after every step; ``breaker(req)`` corrupts the
    request ``rid`` once it has ``break_at[rid]`` output tokens."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for rid, n in list(break_at.items()):
            req = engine.scheduler.requests.get(rid)
            if req is not None and req.num_output_tokens >= n:
                breaker(req)
                del break_at[rid]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    return done


def make_sampler_fail(req: Request) -> None:
    # min_tokens masking with a stop id far outside the vocabulary: index_put_ raises.
    req.params.min_tokens = req.num_output_tokens + 5
    req.params.stop_token_ids = [10**9]


def make_forward_fail(req: Request) -> None:
    # A token id outside the embedding table: the embedding lookup raises.
    req.all_token_ids[-1] = 10**6


@pytest.mark.parametrize("breaker", [make_sampler_fail, make_forward_fail])
def test_bad_request_fails_alone_and_others_are_unchanged(llm: LLM, breaker: Breaker) -> None:
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    expected = [alone(llm, p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, fresh(sp))
    done = run(engine, {"r2": 3}, breaker)
    bad = done["r2"]
    assert bad.error is not None and bad.outputs[0].finish_reason == "error"
    assert len(bad.outputs[0].token_ids) == 3  # what it had before the fault
    for i in (0, 1, 3):
        out = done[f"r{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == expected[i]  # seeded rows too: same draws
    assert alone(llm, PROMPTS[0], GREEDY) == expected[0]  # and the engine goes on


def test_n_siblings_fail_together(llm: LLM) -> None:
    engine = llm.engine
    family = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("fam", {"prompt_token_ids": PROMPTS[0]}, family)
    engine.add_request("ok", {"prompt_token_ids": PROMPTS[1]}, fresh(GREEDY))
    done = run(engine, {"fam#1": 2}, make_sampler_fail)
    assert [c.finish_reason for c in done["fam"].outputs] == ["error"] * 3
    assert done["ok"].outputs[0].token_ids == alone(llm, PROMPTS[1], GREEDY)


def test_every_request_failing_is_not_an_engine_fault_when_the_probe_passes(llm: LLM) -> None:
    expected = alone(llm, PROMPTS[2], GREEDY)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, fresh(GREEDY))
    done = run(engine, {f"r{i}": 1 for i in range(4)}, make_forward_fail)
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert all(o.outputs[0].finish_reason == "error" for o in done.values())
    assert alone(llm, PROMPTS[2], GREEDY) == expected


def test_a_broken_engine_is_an_engine_fault(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, fresh(GREEDY))

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(engine.runner.model, "forward", broken)
    with pytest.raises(EngineFaultError, match="every request of the step failed"):
        engine.step()
    engine.kv.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # the probe's block too
