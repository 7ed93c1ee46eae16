"""Preemption: taking a running request's KV cache away (recompute or swap) for another.

``PreemptionMixin`` is part of ``Scheduler`` (``scheduler.py``), which owns the state it
changes. A running request that cannot grow preempts the policy's victim
(``request_queue.pick_victim``, never one admitted this step); under priority + preempt, a
waiting request whose priority beats a running one's by the threshold preempts it.
``PreemptionMode.SWAP`` moves the victim's blocks to CPU swap space (falling back to
recompute when it is full); ``RECOMPUTE`` frees them, keeping their hashes cached.
"""

from __future__ import annotations

from kvserve.config import KVPolicy, PreemptionMode, SchedulerConfig, SchedulingPolicy
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import RequestQueue, pick_victim
from kvserve.core.runner_views import RunnerViews
from kvserve.core.scheduler_output import SchedulerOutput, SchedulerStats


class PreemptionMixin:
    """``Scheduler``'s preemption steps; the attributes are the scheduler's."""

    config: SchedulerConfig
    kv: KVCacheManager
    policy: SchedulingPolicy
    waiting: RequestQueue
    running: list[Request]
    swapped: RequestQueue
    stats: SchedulerStats
    runner_views: RunnerViews
    _admitted: set[str]

    def _victims(self) -> list[Request]:
        """Running requests a request that cannot grow may preempt: not those admitted this
        step (the background pass runs after the admissions)."""
        if not self._admitted:
            return self.running
        return [r for r in self.running if r.request_id not in self._admitted]

    def _unschedule(self, out: SchedulerOutput, req: Request) -> int:
        """Take a request that is about to be preempted out of this step; its tokens go back
        to the budget (returned)."""
        n = out.num_scheduled_tokens.pop(req.request_id, 0)
        out.scheduled_spec_decode_tokens.pop(req.request_id, None)
        if n:
            out.scheduled.remove(req)
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        req.spec_token_ids = []  # proposed for KV that is going away
        self.runner_views.preempted(req.request_id)
        self.stats.num_preemptions += 1
        req.metrics.num_preemptions += 1
        out.preempted_req_ids.append(req.request_id)
        if self.config.preemption_mode is PreemptionMode.SWAP:
            pairs = self.kv.swap_out(req.request_id)
            if pairs is not None:
                out.blocks_to_swap_out.extend(pairs)
                req.status = RequestStatus.SWAPPED
                self.swapped.prepend(req)
                return
            # Swap space full: fall back to recompute rather than fail the request.
        self.kv.free(req.request_id, keep_hashes=True)  # its blocks stay cached while free
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.prepend(req)

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Priority + preempt: preempt the lowest-priority running request for the waiting
        ``req`` if ``req`` beats it by the threshold; returns the budget given back, or None
        when there is no such victim. Requests admitted this step are never victims (a
        request swapped in this step cannot be swapped out in the same step)."""
        if self.policy is not SchedulingPolicy.PRIORITY or self.config.kv_policy is not (
            KVPolicy.PREEMPT
        ):
            return None
        candidates = [r for r in self.running if r.request_id not in self._admitted]
        if not candidates:
            return None
        victim = pick_victim(candidates, self.policy)
        threshold = self.config.priority_scheduling_preemption_threshold
        if victim.priority - req.priority < threshold:
            return None
        self.running.remove(victim)
        given_back = self._unschedule(out, victim)
        self._preempt(victim, out)
        return given_back
