"""The output side of an engine step: failures, beam decisions, logprobs, text and stop
strings, and the ``EngineOutput``s collected per parent request.

``StepOutputMixin`` is part of ``LLMEngine`` (``llm_engine.py``), which owns the state it
reads and changes (the parent requests, their children's ``CompletionState``s, the beam
groups); ``LLMEngine.step`` calls these steps in order.
"""

from __future__ import annotations

import logging
import time

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.fault_isolation import EngineFaultError, engine_works
from kvserve.engine.output_processor import (
    CompletionState,
    ParentRequest,
    TokenDecoder,
    add_prompt_logprobs,
    token_logprobs,
    update_text,
)
from kvserve.executor import Executor
from kvserve.outputs import EngineOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("kvserve")


class StepOutputMixin:
    """``LLMEngine``'s output steps; the attributes are the engine's."""

    executor: Executor
    kv: KVCacheManager
    scheduler: Scheduler
    tokenizer: PreTrainedTokenizerBase | None
    _backend_tokenizer: Tokenizer | None
    _parents: dict[str, ParentRequest]
    _child_parent: dict[str, ParentRequest]
    _child_state: dict[str, CompletionState]
    _beam_groups: dict[str, BeamGroup]
    _token_texts: dict[int, str]

    def _fail_step(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[str]:
        """Fail the requests whose grammar failed and those the runner failed (and the beam
        searches of failed beams); returns the failed parents' ids. Raises
        ``EngineFaultError`` when every request failed and the engine no longer works."""
        grammar_failed = {
            r.request_id: r.structured_output.error or "grammar failed"
            for r in self.scheduler.take_grammar_failures()
            if r.structured_output is not None
        }
        failed_parents = self._fail_requests(grammar_failed)
        failed_parents += self._fail_requests(out.failed)
        all_failed = bool(out.failed) and len(out.failed) == len(sched.scheduled)
        if all_failed and not engine_works(self.executor, self.kv):
            raise EngineFaultError(f"every request of the step failed: {out.failed}")
        self._fail_beams(out.failed)
        return failed_parents

    def _add_prompt_results(self, out: ModelRunnerOutput) -> None:
        """The step's prompt logprobs and embeddings, onto their requests."""
        for rid, (first, entries) in out.prompt_logprobs.items():
            if (st := self._child_state.get(rid)) is not None:
                add_prompt_logprobs(st.request, first, entries, self._decoder(st.request.params))
        for rid, vector in out.pooled.items():
            if (parent := self._child_parent.get(rid)) is not None:
                parent.embedding = vector

    def _update_outputs(
        self, updated: list[Request], out: ModelRunnerOutput, now: float
    ) -> tuple[list[str], dict[str, str]]:
        """Times, logprobs and text of the requests that got tokens; returns the ids a stop
        string stopped and the reasons of those that failed (grammar, detokenizing)."""
        stopped: list[str] = []
        text_failed: dict[str, str] = {}
        for req in updated:
            rid = req.request_id
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            self._add_logprobs(req, out)
            if req.structured_output is not None and req.structured_output.error:
                text_failed[rid] = req.structured_output.error
                continue
            try:
                hit = self._update_text(req)
            except Exception as exc:  # a token the tokenizer cannot decode, say
                text_failed[rid] = f"detokenizing failed: {exc!r}"
                continue
            if hit:
                if req.status.finished:
                    self.scheduler.restate_finished(req, RequestStatus.FINISHED_STOPPED)
                else:
                    stopped.append(rid)
        return stopped, text_failed

    def _record_finished(
        self, finished: list[Request], now: float, text_failed: dict[str, str]
    ) -> None:
        """Finish reasons and times of the finished requests (an embedding request without
        its embedding joins ``text_failed``)."""
        for req in finished:
            state = self._child_state[req.request_id]
            state.finish_reason = req.status.finish_reason
            if state.stop_reason is None:
                state.stop_reason = req.stop_reason
            req.metrics.finished_time = now
            if req.pooling is not None and self._child_parent[req.request_id].embedding is None:
                text_failed[req.request_id] = "the engine computed no embedding"  # a bug

    def _beam_step(self, out: ModelRunnerOutput) -> tuple[list, list[Request]]:
        """Every live beam search's decision for this step (see ``engine/beam_search.py``):
        ``out.sampled`` rewritten for its beams; returns the forks and holds to apply after
        the scheduler's update."""
        forks: list = []
        holds: list[Request] = []
        for group in self._beam_groups.values():
            for rid in group.beam_ids:
                # no proposals for beams: each step's token is the group's, not the runner's
                out.spec_token_ids.pop(rid, None)
            if not group.finished:
                f, h = group.step(out, out.sampled, self.scheduler)
                forks += f
                holds += h
        return forks, holds

    def _fail_beams(self, failed: dict[str, str]) -> list[str]:
        """Beam searches one of whose beams failed end with finish reason ``error``."""
        done = []
        for group in self._beam_groups.values():
            reason = next((failed[r] for r in group.beam_ids if r in failed), None)
            if reason is not None and not group.finished:
                logger.warning("beam search %s failed: %s", group.request_id, reason)
                group.fail(reason, self.scheduler)  # the others' samples are never appended
                done.append(group.request_id)
        return done

    def _collect_beams(self) -> list[EngineOutput]:
        """Outputs of the beam searches that finished this step (a search streams nothing)."""
        outputs: list[EngineOutput] = []
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        for rid in [r for r, g in self._beam_groups.items() if g.finished]:
            outputs.append(self._beam_groups.pop(rid).output(decode))
        return outputs

    def _add_logprobs(self, req: Request, out: ModelRunnerOutput) -> None:
        """Logprobs of the request's new tokens (one entry each), when it asked for them."""
        rid = req.request_id
        lps = out.sampled_logprob.get(rid)
        if lps is None:
            return
        tops, ranks = out.top_logprobs.get(rid, []), out.sampled_rank.get(rid, [])
        new = req.output_token_ids[len(req.output_token_ids) - req.num_new_tokens :]
        for j, token in enumerate(new):
            req.cumulative_logprob += lps[j]
            req.logprobs.append(
                token_logprobs(
                    token,
                    lps[j],
                    ranks[j] if j < len(ranks) else None,
                    tops[j] if j < len(tops) else {},
                    req.params.logprobs or 0,
                    self._decoder(req.params),
                )
            )

    def _update_text(self, req: Request) -> bool:
        """Detokenize the request's new tokens one by one; True when a stop string matched,
        in which case the tokens after the one that completed it are dropped."""
        state = self._child_state[req.request_id]
        params = self._child_parent[req.request_id].params
        first = req.num_output_tokens - req.num_new_tokens
        for j in range(first, req.num_output_tokens):
            if update_text(state, self._backend_tokenizer, params, req.output_token_ids[j]):
                self.scheduler.truncate_output(req, j + 1)
                return True
        return False

    def _decoder(self, params: SamplingParams) -> TokenDecoder:
        """How a request's logprobs get their ``decoded_token``: None when it has no text."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return self._token_text

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone (vLLM's ``decoded_token``, the server's logprob token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _fail_requests(self, reasons: dict[str, str]) -> list[str]:
        """Finish the parents of the failed child requests (all their children: they share
        the data that failed) with finish reason ``error``; returns the parent ids."""
        parents: list[str] = []
        for cid, reason in reasons.items():
            parent = self._child_parent.get(cid)
            if parent is None or parent.error is not None:
                continue
            logger.warning("request %s failed and is finished: %s", parent.request_id, reason)
            parent.error = reason
            ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            now = time.monotonic()
            for c in parent.children:
                if c.finish_reason is None:
                    c.finish_reason = RequestStatus.FINISHED_ERROR.finish_reason
                    c.request.metrics.finished_time = now
            parents.append(parent.request_id)
        return parents

    def _collect(self, parent_ids: dict[str, None]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for pid in parent_ids:
            parent = self._parents[pid]
            pooling = parent.pooling is not None
            outputs.append(parent.embedding_output() if pooling else parent.output())
            if parent.finished:
                del self._parents[pid]
                for c in parent.children:
                    self._child_parent.pop(c.request.request_id, None)
                    self._child_state.pop(c.request.request_id, None)
        return outputs
