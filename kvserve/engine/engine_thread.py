"""``AsyncLLMEngine``'s engine thread: the only thread that touches the ``LLMEngine``.

``EngineThreadMixin`` is part of ``AsyncLLMEngine`` (``async_engine.py``), which owns the
state: ``_cond`` guards every field both threads use. The loop sleeps on the condition while
there is nothing to do (trimming the heaps, or sleeping the engine, once idle long enough),
applies the callers' commands between steps, steps, publishes the stats and delivers the
outputs to the streams' event loops; a failed step fails the requests in flight and, after
``MAX_CONSECUTIVE_STEP_FAILURES`` in a row, the engine is dead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.engine.async_commands import (
    CallCommand,
    Command,
    EngineDeadError,
    EngineStepError,
    RequestFailedError,
    put_all,
    run_call,
)
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request_stream import RequestStream
from kvserve.executor import WorkerDiedError
from kvserve.ops.malloc_tuning import IDLE_TRIM_SECONDS, trim_heap
from kvserve.outputs import EngineOutput

logger = logging.getLogger("kvserve.async_engine")

# After this many failed steps in a row the engine is declared dead (unhealthy) rather than
# failing every new request forever.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# Smoothing of the finished-request latency that the Retry-After estimate is based on.
_LATENCY_EMA_ALPHA = 0.2

FinishedCallback = Callable[[EngineOutput], None]
# (the step's outputs, the request ids aborted just before it): per-step metrics
StepCallback = Callable[[list[EngineOutput], list[str]], None]


class EngineThreadMixin:
    """``AsyncLLMEngine``'s engine-thread side; the attributes are the async engine's."""

    engine: LLMEngine
    max_queued_requests: int | None
    max_queued_tokens: int | None
    sleep_idle_seconds: float | None
    sleep_idle_level: int
    _cond: threading.Condition
    _commands: list[Command]
    _streams: dict[str, weakref.ref[RequestStream]]
    _orphans: collections.deque[str]
    _pending_seqs: int
    _waiting_seqs: int
    _pending_tokens: int
    _waiting_tokens: int
    _stats: dict[str, Any]
    _stop: bool
    _dead_reason: str | None
    _latency_ema: float | None
    _finished_callbacks: list[FinishedCallback]
    _step_callbacks: list[StepCallback]

    if TYPE_CHECKING:

        def _abort_locked(self, request_id: str) -> bool: ...

    def _run(self) -> None:
        failures = 0
        worked = False  # a step ran since the last heap trim
        idle_since = time.monotonic()  # the end of the last work
        while True:
            with self._cond:
                action = self._wait_for_work_locked(worked, idle_since)
                if self._stop or self._dead_reason is not None:
                    break
                if action is not None and action != "sleep":
                    worked = False
            if action == "trim":
                self._trim_heaps()
                continue
            if action == "sleep":
                self._idle_sleep()
                continue
            with self._cond:
                while self._orphans:
                    self._abort_locked(self._orphans.popleft())
                commands, self._commands = self._commands, []
                # set by an online request queued since the last take (worker/step_interrupt.py)
                self.engine.step_interrupt.clear()
            try:
                self._apply(commands)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            except Exception as exc:
                failures += 1
                self._on_step_failure(exc, failures, [c for c in commands if isinstance(c, str)])
                if self._dead_reason is not None:
                    break
                continue
            failures = 0
            worked = worked or bool(outputs) or bool(commands)
            if outputs or commands:
                idle_since = time.monotonic()
            # Stats first: a consumer that sees an output also sees the step's stats.
            self._publish_stats()
            self._deliver(outputs, [c for c in commands if isinstance(c, str)])
        try:
            self._fail_all(EngineDeadError(self._dead_reason or "the engine was shut down"))
        except Exception:  # the engine is going away anyway; just do not die silently
            logger.exception("could not abort the remaining requests at shutdown")

    def _wait_for_work_locked(self, worked: bool, idle_since: float) -> str | None:
        """Wait (holding ``_cond``) until there is work or an idle action is due; returns
        that action ("trim" or "sleep"), or None when there is work."""
        action = None
        while not self._has_work_locked():
            wait, action = self._idle_action(worked, idle_since)
            if action is None:
                self._cond.wait()
            elif wait > 0:
                self._cond.wait(wait)
                action = None  # woken or timed out: look again
            else:
                break
        return action

    def _idle_action(self, worked: bool, idle_since: float) -> tuple[float, str | None]:
        """The next thing an idle engine does and the seconds until it is due: "trim" the
        heaps IDLE_TRIM_SECONDS after work, "sleep" sleep_idle_seconds after it (None:
        nothing, wait for work)."""
        due: list[tuple[float, str]] = []
        if worked:
            due.append((idle_since + IDLE_TRIM_SECONDS, "trim"))
        if self.sleep_idle_seconds is not None and not self.engine.sleep_level:
            due.append((idle_since + self.sleep_idle_seconds, "sleep"))
        if not due:
            return 0.0, None
        when, action = min(due)
        return when - time.monotonic(), action

    def _idle_sleep(self) -> None:
        """Sleep after sleep_idle_seconds idle; the next request wakes the engine (and its
        time to first token pays it). A failure turns idle sleep off rather than retry."""
        try:
            self.engine.sleep(self.sleep_idle_level, wake_on_request=True)
        except Exception:
            logger.exception("idle sleep failed; --sleep-idle-seconds is off from now on")
            self.sleep_idle_seconds = None
        self._publish_stats()

    def _has_work_locked(self) -> bool:
        return bool(
            self._commands
            or self._stop
            or self._dead_reason is not None  # a worker died (_executor_died)
            or self.engine.has_unfinished_requests()
        )

    def _trim_heaps(self) -> None:
        """Every rank and this process give their freed C heap back to the OS: a burst of
        work (long prompts, prompt logprobs) otherwise stays in the RSS for good."""
        try:
            self.engine.executor.collective_rpc("trim_heap")
            trim_heap()
        except Exception:  # a dead rank is the monitor's business; never fail the loop here
            logger.warning("heap trim on idle failed", exc_info=True)

    def _apply(self, commands: list[Command]) -> None:
        aborts = [c for c in commands if isinstance(c, str)]
        if aborts:
            self.engine.abort_request(aborts)
        for cmd in commands:
            if isinstance(cmd, str):
                continue
            if isinstance(cmd, CallCommand):
                run_call(cmd, self.engine)
                continue
            try:
                self.engine.add_validated(
                    cmd.request_id, cmd.request, cmd.arrival_time, cmd.lora_request
                )
            except Exception as exc:  # this request's own fault: fail just this one
                if not isinstance(exc, ValueError):
                    logger.exception("adding request %s failed", cmd.request_id)
                with self._cond:
                    ref = self._streams.pop(cmd.request_id, None)
                stream = ref() if ref is not None else None
                if stream is not None:
                    self._send([(stream, exc)])
            finally:
                with self._cond:
                    self._pending_seqs -= cmd.n
                    self._pending_tokens -= cmd.num_tokens
        self._publish_stats()

    def _deliver(self, outputs: list[EngineOutput], aborted: list[str] | None = None) -> None:
        items: list[tuple[RequestStream, EngineOutput | BaseException]] = []
        with self._cond:
            for out in outputs:
                ref = self._streams.get(out.request_id)
                stream = ref() if ref is not None else None
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if stream is not None:  # else aborted or collected meanwhile
                    error = None if out.error is None else RequestFailedError(out.error)
                    items.append((stream, error or out))
        for out in outputs:
            if out.finished:
                self._request_finished(out)
        for step_callback in self._step_callbacks:
            try:
                step_callback(outputs, aborted or [])
            except Exception:
                logger.exception("step callback failed")
        self._send(items)

    def _request_finished(self, out: EngineOutput) -> None:
        m = out.metrics
        if m is not None and m.finished_time is not None:
            latency = m.finished_time - m.arrival_time
            prev = self._latency_ema
            self._latency_ema = (
                latency if prev is None else prev + _LATENCY_EMA_ALPHA * (latency - prev)
            )
        for callback in self._finished_callbacks:
            try:
                callback(out)
            except Exception:
                logger.exception("finished-request callback failed")

    def _send(self, items: list[tuple[RequestStream, EngineOutput | BaseException]]) -> None:
        """Hand items to their streams' loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            # A closed loop raises RuntimeError: nobody is listening there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(put_all, batch)

    def _on_step_failure(self, exc: Exception, failures: int, aborted: list[str]) -> None:
        """Fail the in-flight requests, free their blocks, and keep serving if possible.

        ``aborted`` are abort commands taken in the failed iteration, which may not have been
        applied yet.
        """
        logger.exception("engine step failed (%d in a row); failing in-flight requests", failures)
        error = EngineStepError(f"the engine failed while running this request: {exc!r}")
        if isinstance(exc, WorkerDiedError):
            self._dead_reason = str(exc)  # a worker process is gone: no step can succeed
        try:
            self._fail_all(error, aborted)
        except Exception:
            logger.exception("could not abort the failed requests; the engine is now dead")
            self._dead_reason = f"engine failure: {exc!r}"
        if failures >= MAX_CONSECUTIVE_STEP_FAILURES and self._dead_reason is None:
            self._dead_reason = f"{failures} engine steps failed in a row; last: {exc!r}"
        self._publish_stats()

    def _fail_all(self, error: BaseException, aborted: list[str] | None = None) -> None:
        """Fail every known request with ``error`` and abort it in the engine."""
        with self._cond:
            refs, self._streams = self._streams, {}
            # Pending aborts are kept as ids to abort below; pending adds are simply dropped.
            ids = [c for c in self._commands if isinstance(c, str)] + (aborted or [])
            calls = [c for c in self._commands if isinstance(c, CallCommand)]
            self._commands = []
            self._pending_seqs = 0
            self._pending_tokens = 0
        streams = [s for s in (r() for r in refs.values()) if s is not None]
        self._send([(s, error) for s in streams])
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(error)
        self.engine.abort_request([*refs, *ids])

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        # The scheduler's counters refresh on schedule(); the live queue length is more useful
        # for admission control, and reading it is safe here in the engine thread.
        waiting = self.engine.num_waiting()
        # Summing the waiting prompts costs O(waiting) per step: only when a token cap asks.
        waiting_tokens = self.engine.num_waiting_tokens() if self.max_queued_tokens else 0
        with self._cond:
            self._waiting_seqs = waiting
            self._waiting_tokens = waiting_tokens
            stats["num_waiting"] = waiting
            stats["num_pending"] = self._pending_seqs
            stats["num_queued"] = self._pending_seqs + waiting
            stats["max_queued_requests"] = self.max_queued_requests
            stats["healthy"] = self._dead_reason is None
            self._stats = stats
