"""Beam search in the engine: beams are scheduler requests that fork by sharing KV blocks.

A ``BeamGroup`` is one prompt's search. Its live beams are ordinary running ``Request``s that
sample greedily with ``logprobs = 2 * beam_width`` (the runner returns each row's top
candidates from the raw log-softmax). After a step in which every live beam sampled, the
group picks the next beams with ``select_candidates`` (vLLM's rule) *before* the scheduler
appends tokens: a beam whose first surviving candidate is token ``t`` continues as the same
request with ``t`` (the scheduler is the source of truth for tokens, so the runner's own
sample is simply replaced); each further surviving candidate of that beam becomes a child
request forked from it (``Scheduler.fork_request``: its blocks shared, copy-on-write of the
partial last block when written); a beam with no surviving candidate is pruned (finished,
its references dropped). The prompt is computed once, whatever the width.

Preemption: beams advance in lockstep. When only some of a group's beams sampled in a step
(others were preempted or are recomputing), those that sampled are held: no token is
appended and their last position is computed again next step (the same K/V), until the
whole group samples together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    Candidate,
    best_sequences,
    select_candidates,
)
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.lora.request import LoRARequest
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvserve.sampling_params import SamplingParams
from kvserve.worker.runner_output import ModelRunnerOutput

DecodeFn = Callable[[list[int]], str]


@dataclass
class _Beam:
    request: Request  # its tokens and KV blocks, in the scheduler
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token


@dataclass
class _Fork:
    parent: _Beam
    beam: _Beam  # the child, its request not yet in the scheduler
    token_id: int


class BeamGroup:
    """One prompt's beam search: its live beams and finished hypotheses."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        max_tokens: int,
        eos_token_ids: list[int],
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        num_outputs: int | None = None,
        priority: int = 0,
        background: bool = False,
    ) -> None:
        self.request_id = request_id
        self.num_outputs = num_outputs or params.beam_width  # hypotheses returned
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved against the context
        self.eos_token_ids = eos_token_ids
        self.width = params.beam_width
        # What every beam samples with: greedy (the token is replaced anyway), the top 2 * w
        # candidates, and no stop of its own: the group decides EOS and length.
        self.sampling = SamplingParams(
            temperature=0.0, logprobs=2 * self.width, max_tokens=max_tokens, ignore_eos=True,
            detokenize=False,
        )  # fmt: skip
        self._num_children = 0
        self.priority = priority  # every beam's (the priority scheduling policy)
        self.background = background  # every beam's (Request.background)
        first = self._new_request(prompt_token_ids, [], arrival_time, lora_request)
        self.beams: list[_Beam] = [_Beam(first)]
        self.completed: list[BeamSearchSequence] = []
        self.finished = False
        self.error: str | None = None
        self.metrics = first.metrics

    def _new_request(
        self,
        prompt_ids: list[int],
        output_ids: list[int],
        arrival_time: float | None,
        lora_request: LoRARequest | None,
    ) -> Request:
        rid = f"{self.request_id}#beam{self._num_children}"
        self._num_children += 1
        req = Request(rid, prompt_ids, self.sampling, self.max_tokens, [], arrival_time,
                      self.priority, lora_request=lora_request,
                      background=self.background)  # fmt: skip
        req.output_token_ids = list(output_ids)
        req.all_token_ids = [*prompt_ids, *output_ids]
        return req

    @property
    def beam_ids(self) -> list[str]:
        return [b.request.request_id for b in self.beams]

    def sequence(
        self, beam: _Beam, token_id: int, cum: float, entry: TokenLogprobs
    ) -> BeamSearchSequence:
        req = beam.request
        return BeamSearchSequence(
            tokens=[*req.all_token_ids, token_id],
            logprobs=[*beam.logprobs, entry],
            cum_logprob=cum,
        )

    def step(
        self, out: ModelRunnerOutput, sampled: dict[str, list[int]], scheduler: Scheduler
    ) -> tuple[list[_Fork], list[Request]]:
        """Decide this step for the group (before the scheduler's update): rewrite
        ``sampled`` for its beams, finish pruned beams. Returns the forks to make after the
        update and the requests to hold (their last position computed again)."""
        beams = self.beams
        done = [b for b in beams if b.request.request_id in sampled]
        if not done:
            return [], []
        if len(done) < len(beams):  # lockstep: wait for the beams that did not sample
            for b in done:
                del sampled[b.request.request_id]
            return [], [b.request for b in done]
        tops = [out.top_logprobs[b.request.request_id][0] for b in beams]
        entries = [{t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(top.items())} for top in tops]
        kept, ended = select_candidates(
            [b.request.num_tokens for b in beams], [b.cum_logprob for b in beams], tops,
            self.width, self.params.length_penalty, self.eos_token_ids, self.params.ignore_eos,
        )  # fmt: skip
        for c in ended:
            seq = self.sequence(beams[c.parent], c.token_id, c.cum_logprob, entries[c.parent])
            seq.finish_reason, seq.stop_reason = "stop", None
            self.completed.append(seq)
        last = beams[0].request.num_output_tokens + 1 >= self.max_tokens
        if last or not kept:
            for c in kept:
                seq = self.sequence(beams[c.parent], c.token_id, c.cum_logprob, entries[c.parent])
                seq.finish_reason = "length"
                self.completed.append(seq)
            self._finish(sampled, scheduler)
            return [], []
        return self._advance(kept, entries, sampled, scheduler), []

    def _advance(
        self,
        kept: list[Candidate],
        entries: list[TokenLogprobs],
        sampled: dict[str, list[int]],
        scheduler: Scheduler,
    ) -> list[_Fork]:
        """The next beams: each parent continues with its first kept candidate; the others
        are forks of it; parents with none are pruned."""
        old = self.beams
        continued: set[int] = set()
        forks: list[_Fork] = []
        new: list[_Beam] = []
        for c in kept:
            parent = old[c.parent]
            entry = entries[c.parent]
            if c.parent not in continued:
                continued.add(c.parent)
                sampled[parent.request.request_id] = [c.token_id]
                beam = _Beam(parent.request, c.cum_logprob, [*parent.logprobs, entry])
            else:
                req = parent.request
                child = self._new_request(
                    req.prompt_token_ids, [*req.output_token_ids, c.token_id],
                    req.metrics.arrival_time, req.lora_request,
                )  # fmt: skip
                beam = _Beam(child, c.cum_logprob, [*parent.logprobs, entry])
                forks.append(_Fork(parent, beam, c.token_id))
            new.append(beam)
        pruned = [b.request.request_id for i, b in enumerate(old) if i not in continued]
        for rid in pruned:
            sampled.pop(rid, None)
        scheduler.finish_requests(pruned, RequestStatus.FINISHED_ABORTED)
        self.beams = new
        return forks

    def _finish(self, sampled: dict[str, list[int]], scheduler: Scheduler) -> None:
        for rid in self.beam_ids:
            sampled.pop(rid, None)
        self.abort(scheduler)
        self.finished = True
        self.metrics.finished_time = time.monotonic()

    def fail(self, reason: str, scheduler: Scheduler) -> None:
        """A beam's row failed: the search ends with finish reason ``error``."""
        self.error = reason
        self.abort(scheduler)
        self.finished = True
        self.metrics.finished_time = time.monotonic()

    def abort(self, scheduler: Scheduler) -> None:
        """Drop every live beam (their blocks go)."""
        scheduler.finish_requests(self.beam_ids, RequestStatus.FINISHED_ABORTED)
        self.beams = []

    def best(self) -> list[BeamSearchSequence]:
        """The ``beam_width`` best hypotheses, best first."""
        return best_sequences(
            self.completed, self.width, self.params.length_penalty, self.eos_token_ids
        )

    def output(self, decode: DecodeFn | None) -> RequestOutput:
        """The finished search as a ``RequestOutput``: the best ``num_outputs`` hypotheses as
        completions, best first, output tokens only."""
        outputs = []
        plen = len(self.prompt_token_ids)
        for i, seq in enumerate(self.best()[: self.num_outputs]):
            ids = seq.tokens[plen:]
            text_ids = ids
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                text_ids = ids[:-1]  # the EOS ends the text, as a stop token does
            outputs.append(CompletionOutput(
                index=i, text=decode(text_ids) if decode else "", token_ids=ids,
                cumulative_logprob=seq.cum_logprob, logprobs=seq.logprobs,
                finish_reason=seq.finish_reason if self.error is None else "error",
            ))  # fmt: skip
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, True, self.metrics,
            error=self.error,
        )  # fmt: skip


def apply_forks(forks: list[_Fork], holds: list[Request], scheduler: Scheduler) -> None:
    """After the scheduler's update: held beams compute their last position again; each
    fork joins the running batch sharing its parent's blocks (the parent has appended its
    own token this step, so the child's K/V is the parent's up to that position)."""
    for req in holds:
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
    for f in forks:
        child = f.beam.request
        child.num_computed_tokens = f.parent.request.num_computed_tokens
        scheduler.fork_request(f.parent.request, child)
