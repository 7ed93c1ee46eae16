"""Detokenization, stop strings and ``RequestOutput`` assembly (n completions per prompt).

A prompt with ``n > 1`` becomes n child ``Request``s in the scheduler; a ``ParentRequest``
gathers their progress into one ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from kvserve.core.request import Request
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


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

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

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
        )


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that overlaps the last ``new_len`` characters: (index, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def update_text(state: CompletionState, tokenizer: object | None, params: SamplingParams) -> bool:
    """Detokenize the request's newest token; returns True when a stop string matched."""
    if state.stream is None or tokenizer is None:
        return False
    chunk = state.stream.step(tokenizer, state.request.output_token_ids[-1])
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
