"""The request scheduler of ``bench serve``: send each request at its arrival time, at most
``max_concurrency`` at once, and collect the records.

It is independent of HTTP: it takes any ``send(RequestInput) -> RequestRecord`` coroutine, so
the scheduling (arrival times, the concurrency cap, the duration) can be tested with a fake
request function and reused by every endpoint type.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.bench.client import RequestInput, RequestRecord

SendFunc = Callable[[RequestInput], Awaitable[RequestRecord]]
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class RunResult:
    records: list[RequestRecord]  # in the order of the inputs
    duration: float  # seconds from the first scheduled send to the last completion
    max_send_lag: float  # worst delay of a send behind its scheduled time (client overload)


async def run_requests(
    inputs: Sequence[RequestInput],
    send: SendFunc,
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Send ``inputs[i]`` at ``offsets[i]`` seconds after the start through ``send``.

    With ``max_concurrency``, a request that arrives while the cap is reached waits for a slot
    (its wait is ``record.queue_time``); its latency clock starts when it is actually sent, as
    in vLLM, so the cap models a client-side gateway, not server queueing.
    """
    if len(inputs) != len(offsets):
        raise ValueError(f"{len(inputs)} inputs but {len(offsets)} arrival offsets.")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be positive, got {max_concurrency}.")
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    )

    async def one(inp: RequestInput) -> RequestRecord:
        arrived = time.perf_counter()
        async with slots:
            queued = time.perf_counter() - arrived
            record = await send(inp)
        record.queue_time = queued
        if on_done is not None:
            on_done(record)
        return record

    records, duration, max_lag = await launch_at(inputs, one, offsets)
    return RunResult(records, duration, max_lag)


async def launch_at(
    items: Sequence[T], start_one: Callable[[T], Coroutine[Any, Any, R]], offsets: Sequence[float]
) -> tuple[list[R], float, float]:
    """Start ``start_one(items[i])`` at ``offsets[i]`` s; return (results in item order,
    seconds from the start to the last completion, worst lag of a start behind schedule).
    Shared by single requests and multi-turn conversations (one task per conversation)."""
    if len(items) != len(offsets):
        raise ValueError(f"{len(items)} items but {len(offsets)} arrival offsets.")
    start = time.perf_counter()
    max_lag = 0.0
    tasks: list[asyncio.Task[R]] = []
    for item, offset in zip(items, offsets, strict=True):
        # Sleep to an absolute target (not a relative gap) so that timer jitter does not
        # accumulate over a long schedule.
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        max_lag = max(max_lag, time.perf_counter() - (start + offset))
        tasks.append(asyncio.create_task(start_one(item)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start, max_lag
