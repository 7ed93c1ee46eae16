"""Detokenization, stop strings and ``RequestOutput`` assembly (n completions per prompt).

A prompt with ``n > 1`` becomes n child ``Request``s in the scheduler; a ``ParentRequest``
gathers their progress into one ``RequestOutput``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from kvserve.core.request import Request
from kvserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    TokenLogprobs,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

# A token id -> its text (for Logprob.decoded_token), or None when the request has no text.
TokenDecoder = Callable[[int], str] | None


@dataclass
class CompletionState:
    """Text side of one child request."""

    index: int  # position among the parent's n completions
    request: Request  # the scheduler's request (token ids, status)
    stream: DecodeStream | None  # incremental detokenizer; None: no tokenizer or detokenize off
    text: str = ""  # full decoded text, cut at a stop string once one matched
    finish_reason: str | None = None  # set when finished
    stop_reason: int | str | None = None  # matched stop string or stop token id

    def completion(self, params: SamplingParams, hold_back: int) -> CompletionOutput:
        text = self.text
        if self.finish_reason is None and hold_back > 0:
            # Hold back text that might be the start of a stop string, so streams never
            # show a stop string that is later cut off.
            text = text[: max(0, len(text) - hold_back)]
        want_lp = params.logprobs is not None
        req = self.request
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if want_lp else None,
            logprobs=list(req.logprobs) if want_lp else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ParentRequest:
    request_id: str  # the caller's id
    prompt: str | None  # prompt text, when given as text
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams  # the caller's parameters (n children share them, seeds offset)
    children: list[CompletionState] = field(default_factory=list)  # one per completion
    error: str | None = None  # why the engine failed this request (finish reason "error")
    # An embedding request (one child, never samples): its parameters, and its vector once
    # the runner has pooled it
    pooling: PoolingParams | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def embedding_output(self) -> EmbeddingRequestOutput:
        req = self.children[0].request
        return EmbeddingRequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=EmbeddingOutput(list(self.embedding or [])),
            finished=self.finished,
            prompt=self.prompt,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=self.error,
        )

    def output(self) -> RequestOutput:
        hold = max((len(s) for s in self.params.stop_list), default=0) - 1
        first = self.children[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion(self.params, hold) for c in self.children],
            finished=self.finished,
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
            error=self.error,
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
        )


def token_logprobs(
    token: int,
    logprob: float,
    rank: int | None,
    top: dict[int, float],
    num_top: int,
    decode: TokenDecoder,
) -> TokenLogprobs:
    """One generated token's ``Logprob`` dict, in vLLM's order: the sampled token first (its
    rank from the sampler), then the sampler's top ``num_top`` (ranks 1..num_top; ``top`` lists
    them first, most likely first, and appends the sampled token when it is not among them)."""
    entry = {token: Logprob(logprob, rank, decode(token) if decode else None)}
    for r, (tid, lp) in enumerate(top.items()):
        if r >= num_top:
            break
        entry[tid] = Logprob(lp, r + 1, decode(tid) if decode else None)
    return entry


def add_prompt_logprobs(
    req: Request, first: int, entries: list[TokenLogprobs], decode: TokenDecoder
) -> None:
    """Append the prompt logprobs a step computed (``entries`` start at prompt token
    ``first``); entries the request already holds are not added twice."""
    lps = req.prompt_logprobs
    if lps is None or first > len(lps):
        return
    new = entries[len(lps) - first :]
    if decode is not None:
        for entry in new:
            for tid, lp in entry.items():
                lp.decoded_token = decode(tid)
    lps.extend(new)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that overlaps the last ``new_len`` characters: (index, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def update_text(
    state: CompletionState, tokenizer: object | None, params: SamplingParams, token: int
) -> bool:
    """Detokenize the request's next new ``token``; returns True when a stop string matched."""
    if state.stream is None or tokenizer is None:
        return False
    chunk = state.stream.step(tokenizer, token)
    if not chunk:
        return False
    state.text += chunk
    if not params.stop_list:
        return False
    hit = find_stop_string(state.text, len(chunk), params.stop_list)
    if hit is None:
        return False
    idx, stop = hit
    state.text = state.text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
    state.stop_reason = stop
    return True
