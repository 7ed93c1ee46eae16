"""Compiling constraints with xgrammar, off the engine thread, and one matcher per request.

``GrammarCompiler.compile`` hands back a ``Future``: the compile runs on one worker thread
(xgrammar's compiler is C++ and releases the GIL), and equal constraints share one future, so
a schema sent by a thousand requests compiles once. A request whose grammar is not ready yet
waits (``RequestStatus.WAITING_FOR_GRAMMAR``) while the others are admitted.

Measured on the built-in SmolLM2 tokenizer (49152 tokens, AMD EPYC, 2 cores): building the
tokenizer info 0.17 s (once per engine, on the worker thread), compiling a small JSON schema
~1 ms, filling one row's bitmask ~0.07 ms.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvserve.structured_output.params import GrammarError, StructuredOutputsParams

logger = logging.getLogger("kvserve.grammar")

# JSON: the most whitespace characters in a row between two tokens. Unbounded, the built-in
# 135M model at temperature 0.8 wrote newlines until max_tokens (3 of 8 outputs in one run:
# vLLM's known "endless whitespace" failure); with 24, 2 of 64 outputs of the benchmark's
# schema still ran out of max_tokens=256 in 24-newline gaps; with 12, 0 of 128. 12 still allows
# a newline and 5 levels of 2-space indentation.
MAX_WHITESPACE = 12
# Compiled grammars kept (LRU); each is small (KBs to a few MB for large schemas).
_CACHE_SIZE = 256
# xgrammar prefixes its errors with a time stamp and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _reason(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are valid
    EBNF string escapes)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on the worker thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        """The compiled grammar, as a future; its exception is a ``GrammarError`` with the
        compiler's reason. Equal constraints share one future (cached, LRU)."""
        key = params.key()  # raises GrammarError for JSON text that is not JSON
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, params)
            self._futures[key] = future
            while len(self._futures) > _CACHE_SIZE:
                self._futures.popitem(last=False)
            return future

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A request's matcher state over the (possibly still compiling) grammar."""
        return StructuredOutputRequest(self.compile(params), self.vocab_size)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _xgrammar(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            # One thread: the engine's forward passes need both cores.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            compiler = self._xgrammar()
            if kind == "json":
                return compiler.compile_json_schema(
                    params.json,
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE,
                )
            if kind == "json_object":
                # OpenAI's json_object is an object; xgrammar's built-in JSON grammar would
                # also allow `[true]` or `3`.
                return compiler.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE,
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(list(params.choice or [])))
            if kind == "grammar":
                text = params.grammar or ""
                # vLLM's rule: EBNF (GBNF) uses ``::=``; anything else is read as Lark.
                if "::=" in text:
                    return compiler.compile_grammar(text)
                return compiler.compile_lark(text)
            return compiler.compile_structural_tag(params.structural_tag)
        except Exception as e:
            raise GrammarError(f"invalid {kind} for structured outputs: {_reason(e)}") from e


class StructuredOutputRequest:
    """One sequence's grammar state: the compiled grammar (once ready) and its matcher.

    The scheduler and engine use only these methods; the matcher advances with every token the
    sequence accepts and can roll back (speculative decoding's rejected tokens).
    """

    def __init__(self, grammar: Future[Any], vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._matcher: Any = None
        # Why the request cannot go on: the compiler's reason, or a token the grammar refused
        self.error: str | None = None

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

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 ``[G, W]`` bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over the sequence's new tokens; False (and ``error`` set) on a token the
        grammar refuses, which only a broken mask could let through."""
        for t in token_ids:
            if self.matcher.is_terminated():
                return True  # nothing follows the end (the request stops on it)
            if not self.matcher.accept_token(t):
                self.error = f"token {t} does not match the structured output grammar"
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


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
    if len(requests) < _BATCH_FILL_ROWS:
        for g, so in enumerate(requests):
            so.fill_bitmask(bitmask, g)
        return bitmask
    if _batch_matcher is None:
        import xgrammar

        _batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=2)
    _batch_matcher.batch_fill_next_token_bitmask([so.matcher for so in requests], bitmask)
    return bitmask
