"""Steps given up between layers for an online request (``kvserve/worker/step_interrupt.py``):
a given-up step changes nothing, the tokens of every request stay those of a run that was
never interrupted (greedy and seeded), a step is given up only when none of its online rows is
still wanted (background-only, or every online row aborted while it ran), and an online
request queued during such a step on the async engine gives it up."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.core.background import may_give_up, online_ids
from kvserve.core.request import Request
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.worker.step_interrupt import StepInterrupt, StepInterrupted
from tests.engine.utils import random_prompts

PROMPTS = random_prompts([5, 11, 3, 17])
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.8, seed=3, max_tokens=10, ignore_eos=True),
]


def make(path: Path, **kw: object) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4, **kw))  # type: ignore[arg-type]


def add(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams, bg: bool) -> None:
    request = engine.processor.process({"prompt_token_ids": prompt}, sp, 0)
    engine.add_validated(rid, dataclasses.replace(request, background=bg))


def state(engine: LLMEngine) -> dict[str, tuple[int, list[int]]]:
    """Each live request's computed count and tokens."""
    return {
        rid: (r.num_computed_tokens, list(r.all_token_ids))
        for rid, r in engine.scheduler.requests.items()
    }


def run(engine: LLMEngine, interrupt_every: int = 0) -> tuple[dict[str, list[int]], int]:
    """Every prompt as a background request, to the end, checking KV after each step; with
    ``interrupt_every`` k, the flag is set before every k-th step. Returns the tokens and the
    steps that returned nothing because they were given up."""
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        add(engine, str(i), p, sp, bg=True)
    done: dict[str, list[int]] = {}
    given_up, step = 0, 0
    while engine.has_unfinished_requests():
        step += 1
        before = state(engine)
        if interrupt_every and step % interrupt_every == 0:
            engine.step_interrupt.set()
        outs = engine.step()
        engine.step_interrupt.clear()
        if engine.scheduler.stats.num_background_steps_interrupted > given_up:
            given_up += 1
            assert outs == [] and state(engine) == before  # nothing of the step applied
        for out in outs:
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_integrity()
    return done, given_up


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[str, list[int]]:
    done, given_up = run(make(tiny_llama))
    assert given_up == 0 and len(done) == len(PROMPTS)
    return done


@pytest.mark.parametrize("eager", [False, True], ids=["decode-loop", "python-layers"])
def test_given_up_steps_change_no_token(
    tiny_llama: Path, reference: dict[str, list[int]], eager: bool
) -> None:
    engine = make(tiny_llama, enforce_eager=eager)
    loop = engine.runner.model.decode_loop  # type: ignore[union-attr]
    assert (loop is None) == eager, "the C++ decode loop runs unless enforce_eager"
    done, given_up = run(engine, interrupt_every=3)
    assert done == reference
    # 12 steps run to the end (one prefill step, then 11 decode steps to 12 tokens); every
    # third step is given up, so it takes 17: steps 3, 6, 9, 12 and 15 were given up
    assert given_up == engine.scheduler.stats.num_background_steps_interrupted == 5
    if loop is not None:
        assert loop.steps == 11  # the decode steps that ran to the end, each in the loop


def test_given_up_between_layers_rewrites_the_slots(
    tiny_llama: Path, reference: dict[str, list[int]]
) -> None:
    """The flag set while layer 0 runs (the tiny model has two): layer 0 wrote the step's K/V
    slots, the step is given up before layer 1, and the rows written again next step give the
    same tokens."""
    engine = make(tiny_llama, enforce_eager=True)
    layers = engine.runner.model.layers  # type: ignore[union-attr]
    calls = {"n": 0}

    def set_flag(*_: object) -> None:
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            engine.step_interrupt.set()

    assert len(layers) == 2
    handle = layers[0].register_forward_hook(set_flag)
    try:
        done, given_up = run(engine)
    finally:
        handle.remove()
    assert done == reference
    # every fourth forward is given up at layer 1: 12 steps to the end take 15
    assert given_up == engine.scheduler.stats.num_background_steps_interrupted == 3


def test_steps_with_online_rows_run_to_the_end(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    add(engine, "online", PROMPTS[0], PARAMS[0], bg=False)
    add(engine, "batch", PROMPTS[1], PARAMS[1], bg=True)
    steps = 0
    while "online" in engine.scheduler.requests:
        engine.step_interrupt.set()
        engine.step()
        steps += 1
    assert steps == 12  # one prefill step, then one token per step: none given up
    assert engine.scheduler.stats.num_background_steps_interrupted == 0


def test_may_give_up() -> None:
    """The scheduler's rule: rows scheduled and no online request waiting; the online rows
    named for the runner (they must all be aborted before the step gives way)."""
    sp = SamplingParams(max_tokens=1)
    bg = Request("b", [1, 2], sp, 1, [0], background=True)
    online = Request("o", [1, 2], sp, 1, [0])
    out = type("Out", (), {})()
    out.scheduled = [bg]
    assert may_give_up(out, [])  # type: ignore[arg-type]
    assert may_give_up(out, [bg])  # type: ignore[arg-type]
    assert not may_give_up(out, [online])  # type: ignore[arg-type]
    assert online_ids(out) == frozenset()  # type: ignore[arg-type]
    out.scheduled = [bg, online]
    assert may_give_up(out, [])  # type: ignore[arg-type]
    assert online_ids(out) == frozenset({"o"})  # type: ignore[arg-type]
    out.scheduled = []
    assert not may_give_up(out, [])  # type: ignore[arg-type]


def test_flag() -> None:
    """Set exactly when an online request waits and the step in flight has no wanted online
    row; the tensor the C++ loop reads follows."""
    flag = StepInterrupt()
    flag.check()
    flag.set()  # an online request, no step in flight
    assert not flag.is_set()
    flag.begin([])  # a background-only step
    assert flag.is_set() and int(flag.flag.item()) == 1
    with pytest.raises(StepInterrupted):
        flag.check()
    flag.end()
    assert not flag.is_set() and int(flag.flag.item()) == 0
    flag.begin(["a", "c"])  # a step with two online rows
    assert not flag.is_set()
    flag.aborted("a")
    flag.aborted("x")  # not in the step
    assert not flag.is_set()
    flag.aborted("c")
    assert flag.is_set()
    flag.clear()  # the engine took the commands: nothing waits
    assert not flag.is_set()
    flag.aborted("c")  # aborted before nothing waits: no flag
    assert not flag.is_set()
    flag.end()
    flag.aborted("d")  # aborted between the take and the step: the step starts moot
    flag.set()
    flag.begin(["d"])
    assert flag.is_set()
    flag.end()
    flag.clear()
    flag.begin(["d"])  # the take applied d's abort; a new row d is wanted
    flag.set()
    assert not flag.is_set()


@pytest.fixture
def async_engine(tiny_llama: Path) -> Iterator[AsyncLLMEngine]:
    cfg = build_engine_config(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=64,
                              enforce_eager=True)  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(cfg))
    yield engine
    engine.shutdown()


class LayerHold:
    """Holds the engine's next forward of its first layer, once armed, until released: a
    step in flight at a known place (the engine thread waits in the hook)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.armed = False
        engine.runner.model.layers[0].register_forward_hook(self._hold)  # type: ignore[union-attr]

    def _hold(self, *_: object) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.go.wait(30)

    async def arm_and_wait(self) -> None:
        self.armed = True
        assert await asyncio.to_thread(self.entered.wait, 30)


def tokens_alone(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Each request's tokens on a fresh engine of the same config, without interruptions."""
    alone = LLMEngine(engine.config)
    for rid, prompt, sp in requests:
        alone.add_request(rid, {"prompt_token_ids": prompt}, sp)
    done = {}
    while alone.has_unfinished_requests():
        for out in alone.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_an_online_request_gives_the_background_step_up(async_engine: AsyncLLMEngine) -> None:
    """A background step held in its first layer until an online request is queued: it is
    given up at the next layer, and both requests get the tokens they get alone."""
    engine = async_engine.engine
    hold = LayerHold(engine)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main() -> tuple[list[int], list[int]]:
        batch = async_engine.generate({"prompt_token_ids": PROMPTS[3]}, long, "b",
                                      background=True)  # fmt: skip
        first = await batch.__anext__()  # decoding now
        await hold.arm_and_wait()
        online = async_engine.generate({"prompt_token_ids": PROMPTS[0]}, short, "o")
        assert engine.step_interrupt.is_set()
        hold.go.set()
        outs = [o async for o in online]
        rest = [o async for o in batch]
        return outs[-1].outputs[0].token_ids, (rest or [first])[-1].outputs[0].token_ids

    online_ids, batch_ids = asyncio.run(main())
    assert engine.scheduler.stats.num_background_steps_interrupted == 1
    done = tokens_alone(engine, [("o", PROMPTS[0], short), ("b", PROMPTS[3], long)])
    assert online_ids == done["o"] and batch_ids == done["b"]


@pytest.mark.parametrize("with_batch", [False, True], ids=["online-only", "with-batch-row"])
@pytest.mark.parametrize("abort", [True, False], ids=["aborted", "still-wanted"])
def test_a_step_of_an_aborted_request_gives_way(
    async_engine: AsyncLLMEngine, abort: bool, with_batch: bool
) -> None:
    """Back to back: request "a" is decoding (beside a batch line or alone) when its client
    closes it and sends "o"; the step in flight, held in its first layer, has no wanted online
    row left and is given up, so "o" starts one layer later, with the tokens it gets alone.
    A step whose online row is still wanted runs to its end."""
    engine = async_engine.engine
    hold = LayerHold(engine)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    counts = {}

    async def main() -> list[int]:
        batch = None
        if with_batch:
            batch = async_engine.generate({"prompt_token_ids": PROMPTS[3]}, long, "b",
                                          background=True)  # fmt: skip
            await batch.__anext__()
        first = async_engine.generate({"prompt_token_ids": PROMPTS[1]}, long, "a")
        await first.__anext__()  # "a" decodes from now on
        await hold.arm_and_wait()
        # the engine thread waits in the hook: steps given up so far (the batch line's, when
        # "a" arrived during one) are not this test's
        counts["before"] = engine.scheduler.stats.num_background_steps_interrupted
        if abort:
            async_engine.abort("a")  # the client closed it at its first token
        online = async_engine.generate({"prompt_token_ids": PROMPTS[0]}, short, "o")
        assert engine.step_interrupt.is_set() == abort
        hold.go.set()
        outs = [o async for o in online]
        if not abort:
            assert len([o async for o in first][-1].outputs[0].token_ids) == 20
        if batch is not None:
            assert len([o async for o in batch][-1].outputs[0].token_ids) == 20
        return outs[-1].outputs[0].token_ids

    online_tokens = asyncio.run(main())
    given_up = engine.scheduler.stats.num_background_steps_interrupted - counts["before"]
    assert given_up == int(abort)
    assert online_tokens == tokens_alone(engine, [("o", PROMPTS[0], short)])["o"]
    assert len(online_tokens) == 5
