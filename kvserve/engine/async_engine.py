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
import dataclasses
import logging
import math
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from kvserve.beam_search import BeamSearchParams
from kvserve.config import EngineConfig
from kvserve.engine.async_commands import (
    AddCommand,
    CallCommand,
    Command,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestFailedError,
)
from kvserve.engine.engine_thread import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    EngineThreadMixin,
    FinishedCallback,
    StepCallback,
)
from kvserve.engine.input_processor import InputProcessor, ValidatedRequest
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.engine.request_stream import RequestStream
from kvserve.engine.sleep_mode import EngineSleepingError
from kvserve.lora.request import LoRARequest
from kvserve.ops.malloc_tuning import IDLE_TRIM_SECONDS
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.scoring import Scorer
from kvserve.worker.execution_paths import ExecutionPaths

__all__ = [
    "IDLE_TRIM_SECONDS",
    "MAX_CONSECUTIVE_STEP_FAILURES",
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineStepError",
    "FinishedCallback",
    "QueueFullError",
    "RequestFailedError",
    "RequestStream",
    "StepCallback",
]

logger = logging.getLogger("kvserve.async_engine")


class AsyncLLMEngine(EngineThreadMixin):
    """Serve one ``LLMEngine`` to asyncio callers. See the module docstring for the design;
    the engine thread's side is ``engine_thread.py``."""

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
        cmd = AddCommand(request_id, request, time.monotonic(), lora_request=lora_request)
        cmd.num_tokens = len(request.prompt_token_ids) * cmd.n
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._check_queue_room(cmd)
            self._streams[request_id] = weakref.ref(stream)
            self._commands.append(cmd)
            if not request.background:  # the step in flight gives way if it may
                self.engine.step_interrupt.set()
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

    def _check_queue_room(self, cmd: AddCommand) -> None:
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
            self._commands.append(CallCommand(fn, future))
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
        self.engine.step_interrupt.aborted(request_id)  # its rows in the step in flight are moot
        return True

    def _drop_pending_add(self, request_id: str) -> bool:
        """Remove a not-yet-applied add of ``request_id`` (lock held); True if there was one."""
        for i, cmd in enumerate(self._commands):
            if isinstance(cmd, AddCommand) and cmd.request_id == request_id:
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
