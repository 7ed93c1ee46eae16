"""``AsyncLLMEngine``: one ``LLMEngine`` stepping in a background thread, for asyncio servers.

Threading model:

* Only the engine thread touches the ``LLMEngine`` (it is not thread-safe). Callers hand it
  requests and aborts through a lock-protected command list; the thread applies them between
  steps. Torch releases the GIL inside its kernels, so the event loop stays responsive while a
  step runs.
* Each request has a one-slot output collector in its caller's loop (``RequestStream``, like
  vLLM's ``RequestOutputCollector``); the engine thread feeds it with
  ``loop.call_soon_threadsafe`` (one call per loop per step for all requests, not per output).
  Outputs are cumulative, so when the consumer has not yet taken the previous output the new one
  simply replaces it: a consumer that falls behind (a busy event loop) gets one output carrying
  several new tokens instead of a growing backlog, and the deltas it computes stay exact.
* The thread sleeps on a condition variable while there is nothing to do: no busy loop.
* After every step the thread publishes a ``stats()`` snapshot that the loop can read at any
  time without touching the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.beam_search import BeamSearchParams
from kvserve.config import EngineConfig
from kvserve.engine.input_processor import InputProcessor, ValidatedRequest
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.request_stream import RequestStream
from kvserve.engine.sleep_mode import EngineSleepingError
from kvserve.executor import WorkerDiedError
from kvserve.lora.request import LoRARequest
from kvserve.ops.malloc_tuning import IDLE_TRIM_SECONDS, trim_heap
from kvserve.outputs import EngineOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.scoring import Scorer
from kvserve.worker.execution_paths import ExecutionPaths

logger = logging.getLogger("kvserve.async_engine")

# After this many failed steps in a row the engine is declared dead (unhealthy) rather than
# failing every new request forever.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# Smoothing of the finished-request latency that the Retry-After estimate is based on.
_LATENCY_EMA_ALPHA = 0.2

FinishedCallback = Callable[[EngineOutput], None]
# (the step's outputs, the request ids aborted just before it): per-step metrics
StepCallback = Callable[[list[EngineOutput], list[str]], None]


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine was shut down, or failed repeatedly and stopped accepting requests."""


class EngineStepError(RuntimeError):
    """An engine step failed; every request that was in flight is failed with this error."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request's own data; other requests were not affected."""


@dataclass
class _AddCommand:
    request_id: str
    request: ValidatedRequest  # checked at the door; the engine thread admits it as is
    arrival_time: float
    num_tokens: int = 0  # prompt tokens x n: what the request adds to the queued-token count
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model

    @property
    def n(self) -> int:
        """Sequences the request adds to the queue (an embedding request is one)."""
        if self.request.beam_search is not None:
            return self.request.beam_search.beam_width  # one running request per beam
        params = self.request.params
        return params.n if isinstance(params, SamplingParams) else 1


@dataclass
class _CallCommand:
    """Run ``fn(engine)`` on the engine thread between steps (``AsyncLLMEngine.call``)."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


Command = _AddCommand | _CallCommand | str  # str: a request id to abort


class AsyncLLMEngine:
    """Serve one ``LLMEngine`` to asyncio callers. See the module docstring for the design."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int | None = None,
        start: bool = True,
        max_queued_tokens: int | None = None,
        sleep_idle_seconds: float | None = None,
        sleep_idle_level: int = 1,
    ) -> None:
        if sleep_idle_seconds is not None and not engine.config.model.enable_sleep_mode:
            # llama.cpp's flag on vLLM's mode: the idle sleep is the mode's sleep
            raise ValueError("--sleep-idle-seconds needs --enable-sleep-mode")
        if sleep_idle_seconds is not None and sleep_idle_seconds <= 0:
            raise ValueError(f"--sleep-idle-seconds must be positive, got {sleep_idle_seconds}")
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        if max_queued_tokens is not None and max_queued_tokens < 0:
            raise ValueError(f"max_queued_tokens must be >= 0, got {max_queued_tokens}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests  # counts sequences (n per request)
        self.max_queued_tokens = max_queued_tokens  # counts prompt tokens x n of queued sequences
        # idle this long, the engine sleeps at sleep_idle_level; the next request wakes it
        self.sleep_idle_seconds = sleep_idle_seconds
        self.sleep_idle_level = sleep_idle_level
        self._cond = threading.Condition()  # guards every field below that both threads use
        self._commands: list[Command] = []  # adds, and request ids to abort
        # request id -> stream, until finished. Weak, so that a stream its consumer dropped is
        # collected and its request aborted (see RequestStream.__del__).
        self._streams: dict[str, weakref.ref[RequestStream]] = {}
        self._orphans: collections.deque[str] = collections.deque()  # ids of collected streams
        self._pending_seqs = 0  # sequences (n per request) handed over but not yet added
        self._waiting_seqs = 0  # sequences waiting in the engine, as of the last publish
        self._pending_tokens = 0  # prompt tokens x n handed over but not yet added
        self._waiting_tokens = 0  # prompt tokens of waiting sequences, as of the last publish
        self._stats: dict[str, Any] = {}
        self._stop = False
        self._dead_reason: str | None = None
        self._latency_ema: float | None = None  # seconds, of finished requests
        self._finished_callbacks: list[FinishedCallback] = []
        self._step_callbacks: list[StepCallback] = []
        self._publish_stats()
        self._thread = threading.Thread(
            target=self._run, name=f"kvserve-engine-{engine.model_name}", daemon=True
        )
        # A worker process that dies while nothing runs is reported by the executor's monitor:
        # the engine turns unhealthy at once instead of failing the next user's request.
        engine.executor.on_death(self._executor_died)
        if start:
            self.start()

    # -- read-only views of the engine (pure reads, safe from any thread) ---------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def execution_paths(self) -> ExecutionPaths:
        return self.engine.execution_paths

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's defaults for the sampling fields a request leaves unset (read-only)."""
        return self.engine.default_sampling_params

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def processor(self) -> InputProcessor:
        """The front end: tokenization and every request check (thread-safe reads)."""
        return self.engine.processor

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (a request larger than this can never run)."""
        return self.engine.kv_capacity_tokens

    @property
    def kv_info(self) -> dict[str, int]:
        """The KV cache's size: blocks, block size, tokens, bytes, swap blocks."""
        return self.engine.kv_info

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine no longer serves, or None while it does (or has not started yet)."""
        if self._dead_reason is not None:
            return self._dead_reason
        started = self._thread.ident is not None
        if self._stop or (started and not self._thread.is_alive()):
            return "the engine was shut down"
        return None

    def start(self) -> None:
        """Start the engine thread (``start=False`` lets callers queue requests first)."""
        if self._thread.ident is None:
            self._thread.start()

    def add_finished_callback(self, callback: FinishedCallback) -> None:
        """Call ``callback(output)`` for every request that finishes (stop/length).

        It runs in the engine thread, so it must be quick and thread-safe (e.g. Prometheus
        metrics); exceptions are logged and ignored.
        """
        self._finished_callbacks.append(callback)

    def add_step_callback(self, callback: StepCallback) -> None:
        """Call ``callback(outputs, aborted_ids)`` after every engine step with the step's
        outputs (before they reach their streams) and the ids of the requests aborted just
        before it, which will have no more outputs. Per-step facts such as inter-token
        latency are only visible here: a stream coalesces outputs its consumer has not taken.
        Runs in the engine thread, like ``add_finished_callback``; exceptions are logged."""
        self._step_callbacks.append(callback)

    def stats(self) -> dict[str, Any]:
        """The snapshot published after the last step: ``LLMEngine.stats()`` plus queue info."""
        with self._cond:
            return dict(self._stats)

    # -- the caller's side ---------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        background: bool = False,
    ) -> RequestStream:
        """Submit a request and return its output stream: ``async for out in generate(...)``.

        Deliberately not an ``async def`` generator: validation and admission happen here, at
        call time, so bad input raises ``ValueError`` and a full queue ``QueueFullError`` at
        once, before the caller commits to (say) a streaming HTTP response. Must be called from
        a running event loop, which is where the outputs are delivered. ``priority`` orders
        admission under the ``priority`` scheduling policy (lower first, as in vLLM).
        ``lora_request``: the adapter it runs with (registered with ``LLMEngine.add_lora``
        first, through ``call``; the server does so when it loads one). ``background``: a
        Batch API line, run only in the room online requests leave (``Request.background``).
        """
        params = params or self.engine.get_default_sampling_params()
        if lora_request is not None and self.engine.config.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with --enable-lora")
        return self._submit(prompt, params, request_id, priority, lora_request, background)

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        background: bool = False,
    ) -> RequestStream:
        """Submit an embedding request (vLLM's ``encode``): its stream yields one
        ``EmbeddingRequestOutput``, when its prefill is done. Validation, queue caps and
        aborts are ``generate``'s."""
        params = pooling_params or PoolingParams()
        return self._submit(prompt, params, request_id, priority, background=background)

    def beam_search(
        self,
        prompt: PromptType,
        params: BeamSearchParams,
        request_id: str | None = None,
        num_outputs: int | None = None,
        priority: int = 0,
        background: bool = False,
    ) -> RequestStream:
        """Submit a beam search (``LLM.beam_search``'s, for the server's ``use_beam_search``):
        its stream yields one ``RequestOutput`` when it finishes, with the best
        ``num_outputs`` (default: the width) hypotheses, best first. Checks as ``generate``."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        text, ids = self.processor.tokenize_prompt(prompt)
        request = self.processor.validate_beam_search(ids, params, text, num_outputs, priority)
        if background:
            request = dataclasses.replace(request, background=True)
        return self._enqueue(request, request_id)

    def _submit(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str | None,
        priority: int,
        lora_request: LoRARequest | None = None,
        background: bool = False,
    ) -> RequestStream:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        engine = self.engine
        if engine.sleep_level and not engine.wake_on_request:  # a read of two plain fields
            raise EngineSleepingError(
                f"the model {engine.model_name!r} is sleeping (level {engine.sleep_level}); "
                "POST /wake_up first"
            )
        # Tokenized and checked once, here: the engine thread neither tokenizes nor checks again.
        request = self.processor.process(prompt, params, priority)
        if background:
            request = dataclasses.replace(request, background=True)
        return self._enqueue(request, request_id, lora_request)

    def _enqueue(
        self,
        request: ValidatedRequest,
        request_id: str | None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a checked request (within the queue caps) and return its stream."""
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        cmd = _AddCommand(request_id, request, time.monotonic(), lora_request=lora_request)
        cmd.num_tokens = len(request.prompt_token_ids) * cmd.n
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._check_queue_room(cmd)
            self._streams[request_id] = weakref.ref(stream)
            self._commands.append(cmd)
            self._pending_seqs += cmd.n
            self._pending_tokens += cmd.num_tokens
            self._cond.notify()
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Wait until the request's grammar is compiled (in a compile worker process, cached
        by its text), so an invalid schema fails here, before the request is queued; raises
        ``GrammarError`` (a ``ValueError``) with the compiler's reason or the limit it hit.
        Cancelling the caller cancels the compile unless another request waits for it."""
        future = self.engine.compile_grammar(params)
        if future is not None:
            await asyncio.wrap_future(future)

    def _check_queue_room(self, cmd: _AddCommand) -> None:
        """Raise ``QueueFullError`` unless the request's sequences (n of them) and prompt tokens
        fit under the queue caps. Call with the lock held."""
        n = cmd.n
        queued = self._pending_seqs + self._waiting_seqs
        cap = self.max_queued_requests
        if cap is not None and queued + n > cap:
            raise QueueFullError(
                f"the server is busy: {queued} sequences are already queued and this request "
                f"adds {n} (limit {cap}, --max-queued-requests); retry later",
                self._retry_after(),
            )
        tokens = self._pending_tokens + self._waiting_tokens
        cap = self.max_queued_tokens
        if cap is not None and tokens + cmd.num_tokens > cap:
            raise QueueFullError(
                f"the server is busy: {tokens} prompt tokens are already queued and this "
                f"request adds {cmd.num_tokens} (limit {cap}, --max-num-queued-tokens); "
                f"retry later",
                self._retry_after(),
            )

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(engine)`` on the engine thread between two steps (the only thread that may
        touch the ``LLMEngine``); the future holds its result or exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
            self._commands.append(_CallCommand(fn, future))
            self._cond.notify()
        return future

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return int(await asyncio.wrap_future(self.call(LLMEngine.reset_prefix_cache)))

    async def sleep(self, level: int = 1) -> float:
        """``LLMEngine.sleep`` on the engine thread (requests are then refused until
        ``wake_up``); returns its seconds."""
        return float(await asyncio.wrap_future(self.call(lambda e: e.sleep(level))))

    async def wake_up(self) -> float:
        """``LLMEngine.wake_up`` on the engine thread; returns its seconds."""
        return float(await asyncio.wrap_future(self.call(LLMEngine.wake_up)))

    @property
    def scorer(self) -> Scorer:
        """How score and rerank requests score a pair (kvserve/scoring.py)."""
        return self.engine.scorer

    @property
    def is_sleeping(self) -> bool:
        return self.engine.sleep_level > 0  # a plain int the engine thread sets

    def num_unfinished_requests(self) -> int:
        """Requests submitted and not yet finished, failed or aborted (any thread)."""
        with self._cond:
            return len(self._streams)

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with ``error`` (their streams raise it; a streaming
        handler sends it as an error event before ``[DONE]``) and abort them in the engine.
        Thread-safe; the engine keeps serving new requests. Returns how many were failed."""
        with self._cond:
            refs, self._streams = self._streams, {}
            for rid in refs:
                if not self._drop_pending_add(rid):
                    self._commands.append(rid)
            self._cond.notify()
        streams = [s for s in (r() for r in refs.values()) if s is not None]
        self._send([(s, error) for s in streams])
        return len(refs)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its KV blocks are freed before the next
        step. A request not yet handed to the engine is simply dropped."""
        with self._cond:
            if self._abort_locked(request_id):
                self._cond.notify()

    def _abort_locked(self, request_id: str) -> bool:
        """Forget the stream; drop a pending add, else queue an engine abort (returned True)."""
        if self._streams.pop(request_id, None) is None:
            return False  # unknown or already finished
        if self._drop_pending_add(request_id):
            return False
        self._commands.append(request_id)
        return True

    def _drop_pending_add(self, request_id: str) -> bool:
        """Remove a not-yet-applied add of ``request_id`` (lock held); True if there was one."""
        for i, cmd in enumerate(self._commands):
            if isinstance(cmd, _AddCommand) and cmd.request_id == request_id:
                del self._commands[i]
                self._pending_seqs -= cmd.n
                self._pending_tokens -= cmd.num_tokens
                return True
        return False

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight fail with ``EngineDeadError``."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # worker processes end (mp executor)

    def _executor_died(self, reason: str) -> None:
        """The executor's monitor thread: a worker died. Wake the engine thread, which fails
        every request in flight with ``EngineDeadError`` and stops."""
        with self._cond:
            if self._dead_reason is None:
                self._dead_reason = reason
            self._cond.notify()

    def _retry_after(self) -> int:
        """Seconds a rejected client should wait: about one finished request's latency."""
        ema = self._latency_ema or 1.0
        return max(1, min(60, math.ceil(ema)))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        worked = False  # a step ran since the last heap trim
        idle_since = time.monotonic()  # the end of the last work
        while True:
            with self._cond:
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
            if isinstance(cmd, _CallCommand):
                _run_call(cmd, self.engine)
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
                loop.call_soon_threadsafe(_put_all, batch)

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
            calls = [c for c in self._commands if isinstance(c, _CallCommand)]
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


def _run_call(cmd: _CallCommand, engine: LLMEngine) -> None:
    if not cmd.future.set_running_or_notify_cancel():
        return
    try:
        cmd.future.set_result(cmd.fn(engine))
    except Exception as exc:  # the caller's problem, not the engine's
        cmd.future.set_exception(exc)


def _put_all(batch: list[tuple[RequestStream, EngineOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)
