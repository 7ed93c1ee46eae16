"""One request's outputs as an async iterator: the async engine's one-slot collector."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from kvserve.outputs import EngineOutput, RequestOutput

logger = logging.getLogger("kvserve.async_engine")


class StreamOwner(Protocol):
    """What a stream needs of its engine (``AsyncLLMEngine``): somewhere to send aborts."""

    _orphans: collections.deque[str]  # ids of streams dropped unfinished (lock-free appends)

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative ``RequestOutput``s.

    A one-slot collector rather than a queue: ``put`` replaces an output the consumer has not
    taken yet (outputs are cumulative, so the newest holds everything the older one had, and its
    finish state is the latest), so a slow consumer is never more than one item behind and gets
    fewer, larger steps. An error replaces a pending output and is not itself replaced.

    Leaving early aborts the request so its KV blocks are freed: a cancelled ``__anext__``
    (client disconnect, task cancellation), ``aclose()``, or garbage collection all abort.
    """

    def __init__(
        self, request_id: str, engine: StreamOwner, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self.loop = loop
        self._pending: EngineOutput | BaseException | None = None  # not yet taken
        self._waiter: asyncio.Future[None] | None = None  # a consumer waiting in __anext__
        self.finished = False  # the last output (or an error) has been handed to the consumer
        self.num_coalesced = 0  # outputs replaced by a newer one before the consumer took them
        # Called (in the loop) with the finished output when it arrives, taken or not: the
        # server's trace span. None unless tracing is on, so it costs nothing otherwise.
        self.on_finished: Callable[[RequestOutput], None] | None = None

    def __aiter__(self) -> AsyncIterator[EngineOutput]:
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None:
            waiter = self.loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                self.abort()
                raise
            finally:
                self._waiter = None
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def put(self, item: EngineOutput | BaseException) -> None:
        """Called in the stream's loop (via ``call_soon_threadsafe``)."""
        pending = self._pending
        if pending is not None:
            if isinstance(pending, BaseException):
                return  # the stream ends with that error; nothing after it matters
            if not isinstance(item, BaseException):
                self.num_coalesced += 1  # cumulative: the new output supersedes the pending one
        self._pending = item
        if self.on_finished is not None and isinstance(item, RequestOutput) and item.finished:
            try:
                self.on_finished(item)
            except Exception:  # observability must never cost the request its output
                logger.exception("the finished-request hook of %s failed", self.request_id)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self) -> None:
        """Stop the request (idempotent; call it in the stream's loop)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
            # Wake a consumer blocked in __anext__ in another task: it ends its iteration.
            self.put(StopAsyncIteration())

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:
        # A consumer that just dropped the iterator (`break` out of `async for`): the engine
        # holds streams weakly, so this runs, and the engine thread aborts the request. Only a
        # lock-free deque append here: a finalizer can run in any thread, at any point.
        if not self.finished:
            self._engine._orphans.append(self.request_id)
