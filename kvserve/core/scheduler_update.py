"""Applying a step's result: the runner's sampled tokens advance each request.

``OutputUpdateMixin`` is part of ``Scheduler`` (``scheduler.py``), which owns the state it
changes. ``update_from_output`` appends each request's new tokens (1 to k + 1 with
speculative decoding), checks stops after each, rolls ``num_computed_tokens`` back past
rejected proposals, and finishes the requests that stopped; the engine may then restate why
one finished or cut its output at a stop string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.config import KVPolicy, SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.runner_views import RunnerViews
from kvserve.core.scheduler_output import SchedulerOutput, SchedulerStats


class OutputUpdateMixin:
    """``Scheduler``'s update steps; the attributes are the scheduler's."""

    config: SchedulerConfig
    spec: SpeculativeConfig | None
    kv: KVCacheManager
    running: list[Request]
    requests: dict[str, Request]
    stats: SchedulerStats
    runner_views: RunnerViews
    _finished_ids: set[str]

    if TYPE_CHECKING:

        def speculating(self) -> bool: ...

        def _refresh_stats(self) -> None: ...

    def discard_step(self, out: SchedulerOutput) -> None:
        """The runner gave an interruptible step up (``worker/step_interrupt.py``): nothing
        of it is applied. Its rows keep their blocks and computed counts and are scheduled
        again; K/V slots its finished layers wrote lie past their computed counts and are
        written again."""
        assert out.interruptible, "only an interruptible step can be given up"
        self.stats.num_background_steps_interrupted += 1

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """Advance computed counts and append each request's new tokens (1 to k + 1 with
        speculation), checking stops after each one (tokens after a stop are dropped);
        ``spec_token_ids`` are the next step's proposals. Returns (updated, finished)."""
        updated, finished = [], []
        for req in out.scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue  # finished by an abort between schedule and update
            rid = req.request_id
            req.num_computed_tokens += out.num_scheduled_tokens[rid]
            req.num_new_tokens = 0
            tokens = sampled.get(rid)
            if not tokens:
                self.kv.cache_computed_blocks(req)
                if req.pooling is not None and req.num_computed_tokens >= req.num_tokens:
                    # An embedding request ends with its prefill (the runner pooled it).
                    updated.append(req)
                    self._finish(req, RequestStatus.FINISHED_STOPPED, finished)
                continue  # a prefill chunk that did not reach the end
            num_spec = out.num_spec_tokens(req)
            if num_spec:
                self._count_accepted(num_spec, len(tokens) - 1)
            # Rejected proposals' positions hold K/V of the wrong tokens: compute them again.
            req.num_computed_tokens -= num_spec - (len(tokens) - 1)
            status = self._append(req, tokens)
            # A stop inside the run dropped tokens whose positions were computed: only
            # positions of the request's own tokens (all but the newest) count.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv.cache_computed_blocks(req)  # after the append: hashes read the tokens
            updated.append(req)
            if status is not None:
                self._finish(req, status, finished)
                continue
            req.spec_token_ids = self._cap_proposal(req, (spec_token_ids or {}).get(rid, []))
            if num_spec and self.config.kv_policy is KVPolicy.PREEMPT:
                self.kv.trim(rid, req.num_tokens)  # release blocks that held only rejections
        self._refresh_stats()
        return updated, finished

    def _finish(self, req: Request, status: RequestStatus, finished: list[Request]) -> None:
        """A running request is done: free its blocks, tell the runner (next step)."""
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)
        self._finished_ids.add(req.request_id)
        self.runner_views.forget(req.request_id)
        req.status = status
        finished.append(req)

    def restate_finished(self, req: Request, status: RequestStatus) -> None:
        """Change why a request that finished this step finished (a stop string found in
        the same step as its length limit wins, as in vLLM)."""
        if not (req.status.finished and status.finished):
            raise ValueError(f"request {req.request_id}: {req.status} -> {status} is not finished")
        req.status = status

    def truncate_output(self, req: Request, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` output tokens of a request a stop string
        ends inside a speculative run (the engine then finishes it)."""
        before = req.num_output_tokens
        req.truncate_output(num_output_tokens)
        self.stats.num_generation_tokens -= before - req.num_output_tokens

    def _append(self, req: Request, tokens: list[int]) -> RequestStatus | None:
        """Append tokens until one stops the request; returns its finished status or None."""
        for token in tokens:
            req.append_output_token(token)
            req.num_new_tokens += 1
            self.stats.num_generation_tokens += 1
            status = req.check_stop()
            if status is not None:
                return status
        return None

    def _cap_proposal(self, req: Request, proposal: list[int]) -> list[int]:
        """Proposals never reach past max_tokens: the step's k + 1 tokens must all fit."""
        room = req.max_tokens - req.num_output_tokens - 1
        return proposal[: max(0, room)] if self.speculating() else []

    def _count_accepted(self, num_spec: int, num_accepted: int) -> None:
        s = self.stats
        s.spec_decode_num_drafts += 1
        s.spec_decode_num_draft_tokens += num_spec
        s.spec_decode_num_accepted_tokens += num_accepted
        per_pos = s.spec_decode_accepted_per_pos
        k = max(num_spec, self.spec.num_speculative_tokens if self.spec else 0)
        per_pos.extend([0] * (k - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1
