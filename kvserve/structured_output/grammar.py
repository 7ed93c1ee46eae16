"""Compiling constraints with xgrammar in killable worker processes, and one matcher per request.

``GrammarCompiler.compile`` hands back a ``Future`` per caller. The compile itself runs in a
worker process (``compile_worker.py``) under a time and a memory limit, in one of two lanes
by input size (``compile_pool.py``), so a small grammar never queues behind a large one.
Equal constraints share one compile, so a schema sent by a thousand requests compiles once;
when every caller has cancelled its future (the clients went away), the compile is dropped
or its worker killed. Results are kept in an LRU bounded in bytes (``cache_memory``), and
failures (the compiler's reason, or a limit) by count, so a resent bad schema fails at once.
A request whose grammar is not ready yet waits (``RequestStatus.WAITING_FOR_GRAMMAR``) while
the others are admitted.

Measured on the built-in SmolLM2 tokenizer (49152 tokens, AMD EPYC, 2 cores): building the
tokenizer info 0.25 s (once per engine, on a lane's thread), compiling a small JSON schema
~50 ms in the worker and again in the lane's thread (``REPLAY_SECONDS``), a choice ~2 ms,
filling one row's bitmask ~0.07 ms.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from kvserve.config import StructuredOutputsConfig
from kvserve.structured_output.compile_pool import CompileJob, CompileLane, CompileLimits
from kvserve.structured_output.compile_worker import (
    MAX_WHITESPACE,
    choice_grammar,
    compile_params,
)
from kvserve.structured_output.params import GrammarError, StructuredOutputsParams
from kvserve.structured_output.reasoning import Phase, ReasoningState

logger = logging.getLogger("kvserve.grammar")

__all__ = ["MAX_WHITESPACE", "GrammarCompiler", "StructuredOutputRequest", "choice_grammar"]

# Constraints up to this many characters compile in the small lane, longer ones in the
# large lane (a 20-tool chat request's schema is ~10-20 KB; 4,000 tools ~300 KB).
SMALL_GRAMMAR_CHARS = 32 * 1024
# Failed constraints remembered (by hash, with the reason): a resent bad schema fails at once.
_FAILURES_KEPT = 256


def _done(result: Any = None, exc: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
    return future


class _Pending:
    """A compile in flight and how many callers still wait for it."""

    def __init__(self, job: CompileJob, lane: CompileLane) -> None:
        self.job = job
        self.lane = lane
        self.waiters = 0


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and model vocabulary."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._info: Any = None  # xgrammar.TokenizerInfo, built once on a lane's thread
        self._info_lock = threading.Lock()
        self._local = threading.local()  # each lane thread's own xgrammar compiler (replays)
        # Reentrant: a future done at once (a closed lane) runs _finished inside compile()
        self._lock = threading.RLock()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # hash -> CompiledGrammar
        self.cache_bytes = 0
        self._failures: OrderedDict[str, str] = OrderedDict()  # hash -> reason
        self._inflight: dict[str, _Pending] = {}
        limits = CompileLimits(self.config.compile_timeout, self.config.compile_max_memory)
        self.lanes = {
            name: CompileLane(name, self._tokenizer_info, limits, self._decode, self._replay)
            for name in ("small", "large")
        }

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        """The compiled grammar, as a future of the caller's own: cancelling it tells the
        compiler this caller no longer waits (the compile stops once no caller does). Its
        exception is a ``GrammarError`` with the compiler's reason or the limit hit."""
        key = params.key()  # raises GrammarError for JSON text that is not JSON
        # A hash, so a 1 MB schema is not kept (twice) as a dictionary key.
        digest = hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).hexdigest()
        with self._lock:
            grammar = self._cache.get(digest)
            if grammar is not None:
                self._cache.move_to_end(digest)
                return _done(grammar)
            if digest in self._failures:
                return _done(exc=GrammarError(self._failures[digest]))
            pending = self._inflight.get(digest)
            if pending is None:
                lane = self.lanes["small" if len(key[1]) <= SMALL_GRAMMAR_CHARS else "large"]
                pending = self._inflight[digest] = _Pending(CompileJob(params), lane)
                pending.job.future.add_done_callback(lambda f: self._finished(digest, pending))
                lane.submit(pending.job)
            pending.waiters += 1
        waiter: Future[Any] = Future()
        pending.job.future.add_done_callback(lambda f: _relay(f, waiter))
        waiter.add_done_callback(lambda w: w.cancelled() and self._release(digest, pending))
        return waiter

    def new_request(
        self, params: StructuredOutputsParams, reasoning: ReasoningState | None = None
    ) -> StructuredOutputRequest:
        """A request's matcher state over the (possibly still compiling) grammar; with
        ``reasoning`` the grammar applies after the thinking (``reasoning.py``)."""
        return StructuredOutputRequest(self.compile(params), self.vocab_size, reasoning)

    def warm_up(self) -> None:
        """Fork the lanes' workers now (a server calls this), not with the first grammar."""
        for lane in self.lanes.values():
            lane.warm_up()

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            lane.close()

    def _release(self, digest: str, pending: _Pending) -> None:
        """A caller stopped waiting; with no caller left the compile is cancelled."""
        with self._lock:
            pending.waiters -= 1
            if pending.waiters > 0 or pending.job.future.done():
                return
            if self._inflight.get(digest) is pending:
                del self._inflight[digest]
        logger.info("grammar compile cancelled: no request waits for it any more")
        pending.lane.cancel(pending.job)

    def _finished(self, digest: str, pending: _Pending) -> None:
        """Keep the result (or the reason it failed) for the next request with this text."""
        future = pending.job.future
        with self._lock:
            if self._inflight.get(digest) is pending:
                del self._inflight[digest]
            if future.cancelled():
                return
            exc = future.exception()
            if exc is None:
                self._remember(digest, future.result())
            elif isinstance(exc, GrammarError):
                self._failures[digest] = str(exc)
                while len(self._failures) > _FAILURES_KEPT:
                    self._failures.popitem(last=False)

    def _remember(self, digest: str, grammar: Any) -> None:
        """Cache ``grammar``; the least recently used go while over the byte limit (the
        newest stays even alone over it, so the request that compiled it finds it)."""
        self._cache[digest] = grammar
        self.cache_bytes += grammar.memory_size_bytes
        while self.cache_bytes > self.config.cache_memory and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self.cache_bytes -= old.memory_size_bytes

    def _tokenizer_info(self) -> Any:
        with self._info_lock:
            if self._info is None:
                import xgrammar

                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
            return self._info

    def _replay(self, params: StructuredOutputsParams) -> Any:
        """Compile again in this (lane) thread what a worker just compiled fast."""
        compiler = getattr(self._local, "compiler", None)
        if compiler is None:
            import xgrammar

            compiler = xgrammar.GrammarCompiler(
                self._tokenizer_info(), max_threads=1, cache_enabled=False
            )
            self._local.compiler = compiler
        return compile_params(compiler, params)

    def _decode(self, serialized: str) -> Any:
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(serialized, self._tokenizer_info())


def _relay(job: Future[Any], waiter: Future[Any]) -> None:
    """Hand a finished compile to one caller's future (unless that caller cancelled)."""
    try:
        if job.cancelled():
            waiter.set_exception(GrammarError("the grammar compile was cancelled"))
        elif job.exception() is not None:
            waiter.set_exception(job.exception())  # type: ignore[arg-type]
        else:
            waiter.set_result(job.result())
    except InvalidStateError:
        pass  # the caller cancelled first


class StructuredOutputRequest:
    """One sequence's token constraints: the compiled grammar (once ready) and its matcher, and
    with a reasoning model its ``ReasoningState`` (``reasoning.py``): the grammar then takes
    only the answer's tokens, and a spent ``thinking_token_budget`` forces the end marker.

    The scheduler and engine use only these methods; the matcher advances with every answer
    token the sequence accepts and can roll back (speculative decoding's rejected tokens).
    """

    def __init__(
        self,
        grammar: Future[Any] | None,
        vocab_size: int,
        reasoning: ReasoningState | None = None,
    ) -> None:
        self.has_grammar = grammar is not None  # False: only a thinking budget to enforce
        self.grammar = grammar if grammar is not None else _done(None)
        self.vocab_size = vocab_size
        self.reasoning = reasoning
        self._matcher: Any = None
        self._to_matcher: list[bool] = []  # per accepted token: whether the matcher took it
        # Why the request cannot go on: the compiler's reason, or a token the grammar refused
        self.error: str | None = None

    def release(self) -> None:
        """The request ended: stop waiting for its grammar (if still compiling, the compile
        stops once no other request waits for it)."""
        self.grammar.cancel()

    def is_ready(self) -> bool:
        """The compile has finished (successfully or not: see ``check_failed``)."""
        return self.grammar.done()

    def check_failed(self) -> str | None:
        """The compiler's reason when the grammar failed to compile (call once ready)."""
        exc = self.grammar.exception()
        if exc is not None and self.error is None:
            self.error = str(exc)
        return self.error

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.grammar.result())
        return self._matcher

    def prefill_row(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write what needs no grammar into row ``row`` of an all-allowed int32 ``[G, W]``
        bitmask (a forced token; the thinking is free); True when the grammar must fill it."""
        r = self.reasoning
        if r is not None:
            forced = r.forced_token()
            if forced is not None:
                bitmask[row] = 0
                allow_token(bitmask, row, forced)
                return False
            if r.phase is Phase.THINKING:
                return False
        return self.has_grammar

    def finish_row(self, bitmask: torch.Tensor, row: int) -> None:
        """After the grammar filled the row: an undecided output may still open its thinking."""
        start = self.reasoning.may_open() if self.reasoning is not None else None
        if start is not None:
            allow_token(bitmask, row, start)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 ``[G, W]`` bitmask."""
        if self.prefill_row(bitmask, row):
            self.matcher.fill_next_token_bitmask(bitmask, row)
            self.finish_row(bitmask, row)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over the sequence's new tokens; False (and ``error`` set) on a token the
        grammar refuses, which only a broken mask could let through."""
        for t in token_ids:
            answer = self.reasoning.accept(t) if self.reasoning is not None else True
            take = answer and self.has_grammar and not self.matcher.is_terminated()
            self._to_matcher.append(take)
            if take and not self.matcher.accept_token(t):
                self.error = f"token {t} does not match the structured output grammar"
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if num_tokens <= 0:
            return
        undone = self._to_matcher[len(self._to_matcher) - num_tokens :]
        del self._to_matcher[len(self._to_matcher) - num_tokens :]
        if sum(undone):
            self.matcher.rollback(sum(undone))
        if self.reasoning is not None:
            self.reasoning.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set ``token``'s bit in row ``row`` of an int32 ``[G, W]`` bitmask (bit 31 is the sign)."""
    bit = 1 << (token % 32)
    bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


# From this many constrained rows on, the bitmask is filled by xgrammar's batch matcher on two
# threads (the cores are idle between steps): 32 JSON rows took 2.3 ms one by one, 1.4 ms so.
_BATCH_FILL_ROWS = 4
_batch_matcher: Any = None


def grammar_bitmask(requests: list[StructuredOutputRequest]) -> torch.Tensor:
    """int32 ``[G, ceil(V / 32)]``: row g holds the tokens ``requests[g]`` may take next."""
    global _batch_matcher
    from kvserve.sample.logits_processors import bitmask_width

    width = bitmask_width(requests[0].vocab_size)
    bitmask = torch.full((len(requests), width), -1, dtype=torch.int32)  # [G, W]; -1: all
    rows = [g for g, so in enumerate(requests) if so.prefill_row(bitmask, g)]
    if len(rows) < _BATCH_FILL_ROWS:
        for g in rows:
            requests[g].matcher.fill_next_token_bitmask(bitmask, g)
    else:
        if _batch_matcher is None:
            import xgrammar

            _batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=2)
        matchers = [requests[g].matcher for g in rows]
        _batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
    for g in rows:
        requests[g].finish_row(bitmask, g)
    return bitmask
