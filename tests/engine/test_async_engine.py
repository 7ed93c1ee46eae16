"""AsyncLLMEngine: streaming, aborts free blocks, bounded queue, failures keep the loop alive."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve.engine import async_engine as ae
from kvserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
)
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.ops.malloc_tuning import glibc_function
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import StubEngine, random_prompts

PROMPTS = random_prompts([5, 9, 3, 12])
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # long enough to abort
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MID = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

MakeEngine = Callable[..., AsyncLLMEngine]


@pytest.fixture
def make_engine(tiny_llama: Path) -> Iterator[MakeEngine]:
    """A factory of AsyncLLMEngines over the tiny model; all are shut down afterwards."""
    made: list[AsyncLLMEngine] = []

    def make(max_queued: int | None = None, start: bool = True, **kw: object) -> AsyncLLMEngine:
        kw.setdefault("num_kv_blocks", 256)
        cfg = build_engine_config(str(tiny_llama), dtype="float32", block_size=4, **kw)  # type: ignore[arg-type]
        engine = AsyncLLMEngine(LLMEngine(cfg), max_queued_requests=max_queued, start=start)
        made.append(engine)
        return engine

    yield make
    for e in made:
        e.shutdown()


async def collect(stream: ae.RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


async def wait_idle(engine: AsyncLLMEngine, timeout: float = 5.0) -> dict[str, object]:
    """The stats once nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        idle = s["num_running"] == 0 and s["num_queued"] == 0
        if idle and s["num_free_kv_blocks"] == s["num_kv_blocks"]:
            return s
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        await asyncio.sleep(0.02)


async def test_streams_match_the_sync_engine(make_engine: MakeEngine, tiny_llama: Path) -> None:
    engine = make_engine()
    results = await asyncio.gather(*(collect(engine.generate(p, SHORT)) for p in PROMPTS))
    ref = LLMEngine(build_engine_config(str(tiny_llama), dtype="float32", block_size=4))
    for prompt, outs in zip(PROMPTS, results, strict=True):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        # Outputs are cumulative: each extends the previous one.
        for a, b in itertools.pairwise(outs):
            assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        ref.add_request("r", {"prompt_token_ids": prompt}, SHORT)
        while ref.has_unfinished_requests():
            (final,) = ref.step()
        assert outs[-1].outputs[0].token_ids == final.outputs[0].token_ids
    s = await wait_idle(engine)
    assert s["num_generation_tokens"] == len(PROMPTS) * SHORT.max_tokens


async def test_bad_input_raises_at_call_time_and_the_loop_keeps_serving(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SHORT)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.generate([5, 9999], SHORT)
    with pytest.raises(ValueError, match="context"):
        engine.generate([5] * 600, SHORT)  # the tiny model's context is 512
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("text needs a tokenizer", SHORT)
    outs = await collect(engine.generate(PROMPTS[0], SHORT, request_id="same"))
    assert len(outs[-1].outputs[0].token_ids) == SHORT.max_tokens
    stream = engine.generate(PROMPTS[0], LONG, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.generate(PROMPTS[1], SHORT, request_id="dup")
    await stream.aclose()
    await wait_idle(engine)


async def test_aclose_aborts_and_frees_blocks(make_engine: MakeEngine) -> None:
    engine = make_engine()
    stream = engine.generate(PROMPTS[1], LONG)
    first = await stream.__anext__()
    assert not first.finished
    assert engine.stats()["num_free_kv_blocks"] < engine.stats()["num_kv_blocks"]
    await stream.aclose()
    s = await wait_idle(engine)
    assert s["num_generation_tokens"] < LONG.max_tokens  # it really stopped early
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_cancelled_consumer_aborts(make_engine: MakeEngine) -> None:
    engine = make_engine()
    seen = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[2], LONG):
            seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(seen.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = await wait_idle(engine)
    assert s["num_generation_tokens"] < LONG.max_tokens


async def test_dropped_iterator_aborts(make_engine: MakeEngine) -> None:
    engine = make_engine()
    async for _ in engine.generate(PROMPTS[3], LONG):
        break  # `async for` does not close the iterator: the finalizer must abort
    gc.collect()
    s = await wait_idle(engine)
    assert s["num_generation_tokens"] < LONG.max_tokens


async def test_queue_full_is_immediate(make_engine: MakeEngine) -> None:
    # Not started: nothing is handed over yet, so the count is deterministic.
    engine = make_engine(max_queued=2, start=False, max_num_seqs=1)
    a = engine.generate(PROMPTS[0], SHORT)
    b = engine.generate(PROMPTS[1], SHORT)
    t0 = time.monotonic()
    with pytest.raises(QueueFullError) as info:
        engine.generate(PROMPTS[2], SHORT)
    assert time.monotonic() - t0 < 0.1
    assert info.value.retry_after >= 1
    engine.start()
    outs = await asyncio.gather(collect(a), collect(b))
    assert all(o[-1].finished for o in outs)
    await wait_idle(engine)
    # Room again once the queue drained.
    assert (await collect(engine.generate(PROMPTS[2], SHORT)))[-1].finished


async def test_aborting_a_queued_request_frees_its_slot(make_engine: MakeEngine) -> None:
    engine = make_engine(max_queued=1, start=False)
    a = engine.generate(PROMPTS[0], SHORT)
    with pytest.raises(QueueFullError):
        engine.generate(PROMPTS[1], SHORT)
    await a.aclose()
    b = engine.generate(PROMPTS[1], SHORT)
    engine.start()
    assert (await collect(b))[-1].finished


async def test_step_failure_fails_in_flight_requests_and_keeps_serving(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    with pytest.raises(EngineStepError, match="injected failure"):
        await collect(engine.generate(PROMPTS[0], LONG))
    await wait_idle(engine)  # the failed request's blocks were freed
    assert engine.is_healthy
    outs = await collect(engine.generate(PROMPTS[1], SHORT))
    assert len(outs[-1].outputs[0].token_ids) == SHORT.max_tokens


async def test_repeated_failures_mark_the_engine_dead(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("always broken")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    for _ in range(ae.MAX_CONSECUTIVE_STEP_FAILURES - 1):
        with pytest.raises(EngineStepError):
            await collect(engine.generate(PROMPTS[0], SHORT))
    with pytest.raises((EngineStepError, EngineDeadError)):
        await collect(engine.generate(PROMPTS[0], SHORT))
    deadline = time.monotonic() + 5
    while engine.is_healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not engine.is_healthy and not engine.stats()["healthy"]
    with pytest.raises(EngineDeadError):
        engine.generate(PROMPTS[0], SHORT)


async def test_shutdown_fails_in_flight_requests(make_engine: MakeEngine) -> None:
    engine = make_engine()
    stream = engine.generate(PROMPTS[0], LONG)
    await stream.__anext__()
    await asyncio.to_thread(engine.shutdown)
    with pytest.raises(EngineDeadError):
        await collect(stream)
    with pytest.raises(EngineDeadError):
        engine.generate(PROMPTS[0], SHORT)


async def test_idle_thread_sleeps(make_engine: MakeEngine) -> None:
    engine = make_engine()
    await collect(engine.generate(PROMPTS[0], SHORT))
    await wait_idle(engine)
    cpu0 = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - cpu0 < 0.1  # a busy loop would burn ~0.5 s of CPU


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


@pytest.mark.skipif(glibc_function("malloc_trim") is None, reason="glibc's malloc_trim")
async def test_an_idle_engine_gives_the_freed_heap_back(make_engine: MakeEngine) -> None:
    """The runner keeps freed heap for speed (malloc_tuning); once idle the engine trims it."""
    engine = make_engine()
    await collect(engine.generate(PROMPTS[0], SHORT))
    garbage = b"\x01" * (96 * 2**20)  # touched heap pages, as a big prefill leaves behind
    held = rss_mib()
    del garbage  # freed, but kept in the heap: the trim threshold is 2 GiB
    await asyncio.sleep(0.2)
    assert rss_mib() > held - 16, "freed heap went back before the idle trim"
    await asyncio.sleep(ae.IDLE_TRIM_SECONDS + 1.5)
    assert rss_mib() < held - 80  # the trim handed the 96 MiB back


async def test_finished_callback_runs_once_per_request(make_engine: MakeEngine) -> None:
    engine = make_engine()
    finished: list[str] = []
    engine.add_finished_callback(lambda out: finished.append(out.request_id))
    await asyncio.gather(
        *(collect(engine.generate(p, SHORT, f"r{i}")) for i, p in enumerate(PROMPTS))
    )
    assert sorted(finished) == [f"r{i}" for i in range(len(PROMPTS))]


async def test_a_slow_consumer_gets_coalesced_outputs_with_the_same_tokens(
    make_engine: MakeEngine,
) -> None:
    # The same greedy request twice, in one batch: both get an output at every step. (With
    # prefix caching the second would wait a step to share the first one's prompt blocks.)
    engine = make_engine(enable_prefix_caching=False)
    fast = engine.generate(PROMPTS[1], MID, request_id="fast")
    slow = engine.generate(PROMPTS[1], MID, request_id="slow")
    first = await slow.__anext__()
    fast_outs = await collect(fast)  # meanwhile the slow consumer takes nothing
    slow_outs = [first, *[out async for out in slow]]
    # The slow consumer's pending output was replaced at every step: it gets the first and
    # the final output only, and nothing was lost or duplicated.
    assert len(slow_outs) == 2 < len(fast_outs)
    assert len(slow_outs) + slow.num_coalesced == MID.max_tokens  # one output per step
    assert len(fast_outs) + fast.num_coalesced == MID.max_tokens
    assert [o.finished for o in slow_outs] == [False, True]
    final = slow_outs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == MID.max_tokens
    assert final.token_ids == fast_outs[-1].outputs[0].token_ids
    # The deltas a streaming consumer computes add up to the same tokens.
    deltas: list[int] = []
    for out in slow_outs:
        deltas += out.outputs[0].token_ids[len(deltas) :]
    assert deltas == fast_outs[-1].outputs[0].token_ids
    await wait_idle(engine)


def _output(ids: list[int], finish: str | None = None) -> RequestOutput:
    done = finish is not None
    comp = CompletionOutput(0, "", ids, None, None, finish_reason=finish)
    return RequestOutput("r", None, [1], [comp], finished=done)


async def test_request_stream_keeps_only_the_newest_output_and_errors_win() -> None:
    loop = asyncio.get_running_loop()
    stub = StubEngine()
    stream = ae.RequestStream("r", stub, loop)  # type: ignore[arg-type]
    stream.put(_output([7]))
    stream.put(_output([7, 8]))
    stream.put(_output([7, 8, 9]))
    assert (await stream.__anext__()).outputs[0].token_ids == [7, 8, 9]
    assert stream.num_coalesced == 2
    # A consumer waiting in __anext__ is woken by put.
    waiting = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    assert not waiting.done()
    stream.put(_output([7, 8, 9, 10], "length"))
    assert (await waiting).finished
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert stub.aborted == []  # it finished: nothing to abort

    # An error replaces a pending output, and is not replaced by a later one.
    errored = ae.RequestStream("e", stub, loop)  # type: ignore[arg-type]
    errored.put(_output([1]))
    errored.put(EngineStepError("boom"))
    errored.put(_output([1, 2]))
    with pytest.raises(EngineStepError, match="boom"):
        await errored.__anext__()
    with pytest.raises(StopAsyncIteration):
        await errored.__anext__()

    # Aborting from another task ends the waiting consumer's iteration.
    aborted = ae.RequestStream("a", stub, loop)  # type: ignore[arg-type]
    consumer = asyncio.ensure_future(collect(aborted))
    await asyncio.sleep(0)
    aborted.abort()
    assert await consumer == []
    assert stub.aborted == ["a"]
