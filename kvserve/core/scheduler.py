"""Continuous-batching scheduler, in token counts (vLLM v1 style).

Every request carries ``num_computed_tokens``; each step hands out ``num_scheduled_tokens``
per request within ``max_num_batched_tokens``. A prefill is just a request far behind its
token count, so prefills (chunked when large) and decodes mix freely in one step.

The KV policy decides admission and what happens when blocks run out:
- ``KVPolicy.PREEMPT``: admit while blocks are free; a running request that cannot grow
  preempts the newest running request (FCFS keeps the oldest going), by recompute or swap.
- ``KVPolicy.RESERVE``: admit only when prompt + max_tokens fit, and hold those blocks;
  running requests then always have room, so nothing is ever preempted.

Speculative decoding: a running request's proposed tokens (``spec_token_ids``) count in its
token total (``num_tokens_with_spec``), so a decode row computes its last token plus the k
proposals in one step; the runner returns the accepted run (1..k+1 tokens) and
``update_from_output`` appends them one by one, checking stops after each, and rolls
``num_computed_tokens`` back past the rejected positions.

The scheduling policy (``request_queue.py``) orders the waiting and swapped queues and picks
preemption victims: FCFS, or priority (lower value first). Under priority + preempt, a waiting
request whose priority beats a running one's by the threshold may preempt it.

Beam search (``fork_request``): a beam forks into a child that shares all its blocks and
joins the running batch at once, computed as far as its parent; before a step writes a
request's tokens, any block it shares is copied (``KVCacheManager.copy_on_write``, the pairs
in ``blocks_to_copy``). Pruning a beam is finishing it (``finish_requests``).

Background work (``Request.background``: Batch API lines) takes only the room online requests
leave: its running rows sit out every step that computes an online request's prompt (so an
online request's time to first token does not pay for them), and a background request
waiting is not admitted while an online one waits or prefills (``core/background.py``).

Multi-LoRA: the running requests never use more than ``max_loras`` distinct adapters (the
runner's device slots); a waiting request whose adapter would be one too many stays in the
queue while those behind it go ahead (vLLM v1's rule).
"""

from __future__ import annotations

import time

from kvserve.config import CacheConfig, KVPolicy, SchedulerConfig, SpeculativeConfig
from kvserve.core.background import (
    holds_background_back,
    may_give_up,
    online_ids,
    online_prefill_scheduled,
)
from kvserve.core.block_pool import BlockHash
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_for
from kvserve.core.preemption import PreemptionMixin
from kvserve.core.request import Request, RequestStatus
from kvserve.core.request_queue import create_request_queue, pick_victim
from kvserve.core.runner_views import RunnerViews
from kvserve.core.scheduler_output import SchedulerOutput, SchedulerStats
from kvserve.core.scheduler_update import OutputUpdateMixin

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerStats"]


class Scheduler(PreemptionMixin, OutputUpdateMixin):
    """Owns the request queues and decides each step (``schedule``); preemption is in
    ``preemption.py``, applying a step's result (``update_from_output``) in
    ``scheduler_update.py``."""

    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        kv: KVCacheManager,
        spec: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.config = sched
        self.max_loras = max_loras  # most distinct adapters running at once; None: LoRA off
        self.spec = spec
        # KV slots held past a request's scheduled tokens for the draft model's proposals
        self.lookahead = 0 if spec is None else spec.num_lookahead_slots
        self.block_size = cache.block_size
        self.kv = kv
        self.policy = sched.scheduling_policy
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []  # in admission order
        self.swapped = create_request_queue(self.policy)
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._admitted: set[str] = set()  # ids admitted this step: never preempted in it
        # Hashes of blocks that requests scheduled this step complete: a waiting request whose
        # next block is among them waits a step and then finds it cached (n > 1 siblings, or
        # users arriving together with one system prompt, compute it once).
        self._pending: set[BlockHash] = set()
        # Requests whose grammar is still compiling: they join `waiting` once it is ready, so
        # they never block the line; those whose grammar failed wait for the engine to fail them.
        self.waiting_for_grammar: list[Request] = []
        self.grammar_failed: list[Request] = []
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        # what the runner holds of each request: the step message carries only the changes
        self.runner_views = RunnerViews()

    # -- queue management -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.structured_output is not None and not req.structured_output.is_ready():
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(req)
        else:
            self._enqueue(req)
        self._refresh_stats()

    def _enqueue(self, req: Request) -> None:
        if req.structured_output is not None and req.structured_output.check_failed():
            self.grammar_failed.append(req)
            return
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def _promote_ready_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue (by policy order)."""
        still = []
        for req in self.waiting_for_grammar:
            if req.structured_output is not None and req.structured_output.is_ready():
                self._enqueue(req)
            else:
                still.append(req)
        self.waiting_for_grammar = still

    def take_grammar_failures(self) -> list[Request]:
        """Requests whose grammar failed to compile; the engine finishes them with the reason."""
        failed, self.grammar_failed = self.grammar_failed, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.waiting or self.running or self.swapped or self.waiting_for_grammar
        ) or bool(self.grammar_failed)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests wherever they are (abort, stop string); frees their blocks at once."""
        done = []
        for rid in req_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for queue in (self.waiting, self.running, self.swapped):
                if req in queue:
                    queue.remove(req)
            for pending in (self.waiting_for_grammar, self.grammar_failed):
                if req in pending:
                    pending.remove(req)
            if req.structured_output is not None:
                req.structured_output.release()  # a compile nobody else waits for stops
            self.kv.free(rid)
            self._finished_ids.add(rid)
            self.runner_views.forget(rid)
            req.status = status
            done.append(req)
        self._refresh_stats()
        return done

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], {}, {})
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        self._admitted.clear()
        self._pending.clear()
        if self.waiting_for_grammar:
            self._promote_ready_grammars()
        if self.spec is not None and not self.speculating():
            # A big batch (counted before this step's admissions): verify nothing this step.
            for req in self.running:
                req.spec_token_ids = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, False)
        # Like vLLM: no new admissions in a step that had to preempt; swapped requests are
        # older than anything waiting, so they come back first.
        if not out.preempted_req_ids:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                budget = self._schedule_waiting(out, budget)
        if not online_prefill_scheduled(out):
            self._schedule_running(out, budget, True)
        else:
            self.stats.num_background_rows_held += sum(r.background for r in self.running)
        now = time.monotonic()
        for req in out.scheduled:
            blocks = out.block_tables[req.request_id] = self.kv.block_ids(req.request_id)
            self.runner_views.describe(out, req, blocks)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        self._grammar_bitmask(out)
        out.propose = self.speculating()  # the batch after admissions: worth proposing for?
        out.interruptible = may_give_up(out, self.waiting)
        out.online_ids = online_ids(out)
        if out.scheduled:
            self.stats.num_steps += 1
            by_running = self.stats.num_steps_by_running
            by_running[len(self.running)] = by_running.get(len(self.running), 0) + 1
        self.stats.max_num_running = max(self.stats.max_num_running, len(self.running))
        self._refresh_stats()
        return out

    def speculating(self) -> bool:
        """Whether this step's batch is small enough to speculate (disable_by_batch_size)."""
        if self.spec is None:
            return False
        limit = self.spec.disable_by_batch_size
        return limit is None or len(self.running) <= limit

    def _grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The allowed next tokens of every constrained request that samples this step."""
        constrained = [r for r in out.scheduled if r.structured_output and out.samples(r)]
        if not constrained:
            return
        from kvserve.structured_output.grammar import grammar_bitmask

        out.grammar_bitmask = grammar_bitmask([r.structured_output for r in constrained])
        out.structured_output_rows = {r.request_id: g for g, r in enumerate(constrained)}

    def _take(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.scheduled.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        num_spec = req.num_computed_tokens + n - req.num_tokens
        if num_spec > 0:
            out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_spec]
        if self.kv.enable_caching:
            # Proposed tokens may be rejected: only the request's own tokens complete blocks.
            first = req.num_computed_tokens // self.block_size
            end = min(req.num_computed_tokens + n, req.num_tokens)
            if end // self.block_size > first:  # completes blocks (rare for a decode)
                self._pending.update(self.kv.block_hashes(req, end)[first:])

    def _waits_for_pending(self, req: Request, computed: list[int]) -> bool:
        """True when the request's first uncached block is being computed this step."""
        if not self.kv.enable_caching:
            return False
        hashes = self.kv.block_hashes(req, req.num_tokens - 1)
        return len(computed) < len(hashes) and hashes[len(computed)] in self._pending

    def _lora_blocked(self, req: Request, ids: set[int]) -> bool:
        """True when ``req``'s adapter would be one more than ``max_loras`` beside ``ids``."""
        lid = req.lora_int_id
        return (
            self.max_loras is not None and lid != 0 and lid not in ids
            and len(ids) >= self.max_loras
        )  # fmt: skip

    def _schedule_running(self, out: SchedulerOutput, budget: int, background: bool) -> int:
        """Schedule the running requests of one class (online, or background after the
        admissions) that this step has not scheduled yet; returns the budget left. A request
        that cannot grow preempts one (never one admitted this step)."""
        idx = 0
        loras = {r.lora_int_id for r in out.scheduled if r.lora_int_id}  # adapters this step
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            if req.background != background or req.request_id in out.num_scheduled_tokens:
                idx += 1
                continue
            if self._lora_blocked(req, loras):  # never while admissions keep the cap
                idx += 1
                continue
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if self.lookahead:  # best effort: the draft proposes only into slots it holds
                self.kv.allocate_slots(req.request_id, self._slots(req, n))
            while not self._grow(out, req, n):
                if self.config.kv_policy is KVPolicy.RESERVE:
                    raise RuntimeError("reserve policy ran out of reserved blocks")  # a bug
                victim = pick_victim(self._victims(), self.policy)
                victim_idx = self.running.index(victim)
                del self.running[victim_idx]
                budget += self._unschedule(out, victim)  # scheduled earlier this step
                self._preempt(victim, out)
                if victim is req:
                    break
                if victim_idx < idx:
                    idx -= 1
                n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if req.status is not RequestStatus.RUNNING:
                continue  # it preempted itself; running[idx] is now the next request
            self._take(out, req, n)
            budget -= n
            idx += 1
        return budget

    def _grow(self, out: SchedulerOutput, req: Request, n: int) -> bool:
        """Blocks for ``n`` more tokens of a running request, and its own copy of any block
        it shares with a forked beam that those tokens write; False when blocks run out."""
        rid = req.request_id
        if self.kv.allocate_slots(rid, req.num_computed_tokens + n) is None:
            return False
        pairs = self.kv.copy_on_write(rid, req.num_computed_tokens)
        if pairs is None:
            return False
        out.blocks_to_copy.extend(pairs)
        return True

    def fork_request(self, parent: Request, child: Request) -> None:
        """Beam search: ``child`` (the parent's tokens, computed as far as the parent's)
        joins the running batch right after its parent, sharing its blocks (no copy, no
        recompute). The parent must be running."""
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {parent.request_id} is not running; it cannot fork")
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        if child.num_computed_tokens > parent.num_computed_tokens:
            raise ValueError("a fork cannot be computed further than its parent")
        self.kv.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        child.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)
        self._refresh_stats()

    def _slots(self, req: Request, n: int) -> int:
        """Token slots the request must hold to compute ``n`` more tokens: with a draft model,
        also the lookahead its proposals write (never past what the request can ever hold)."""
        end = req.num_computed_tokens + n
        if self.lookahead and end >= req.num_tokens:
            end = min(end + self.lookahead, req.max_total_tokens)
        return end

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.swapped.peek()
            if self._lora_blocked(req, self._running_loras()):
                break  # its adapter waits for a slot; swapped requests keep their order
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = blocks_for(req.num_computed_tokens + n, self.block_size)
            if not self.kv.can_allocate(max(need, self.kv.num_swapped_blocks(req.request_id))):
                break
            pairs = self.kv.swap_in(req.request_id)
            assert pairs is not None  # room was checked above
            out.blocks_to_swap_in.extend(pairs)
            if self.kv.allocate_slots(req.request_id, self._slots(req, n)) is None:
                self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)  # no lookahead
            self.swapped.pop()
            self._admit(out, req, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in queue order; returns the budget left."""
        skipped: list[Request] = []  # no adapter slot, or background held back: keep places
        try:
            return self._admit_waiting(out, budget, skipped)
        finally:
            for req in reversed(skipped):
                self.waiting.prepend(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, skipped: list[Request]) -> int:
        loras = self._running_loras()
        while self.waiting and budget > 0:
            req = self.waiting.peek()  # waiting requests hold no blocks: nothing is computed
            if self._lora_blocked(req, loras) or (
                req.background and holds_background_back(out, self.waiting)
            ):
                skipped.append(self.waiting.pop())
                continue
            skip = req.skips_prefix_cache  # prompt logprobs need the logits of every position
            computed = [] if skip else self.kv.get_computed_blocks(req)  # a hit, whole blocks
            if not skip and self._waits_for_pending(req, computed):
                break  # one step later that block is cached: compute it once
            hit = len(computed) * self.block_size
            n = min(req.num_tokens - hit, budget)
            fits = len(self.running) < self.config.max_num_seqs
            if not fits or not self._allocate_new(req, hit + n, computed):
                given_back = self._preempt_for(req, out)
                if given_back is None:
                    break  # the head of the line waits; nothing behind it jumps ahead
                budget += given_back
                continue
            self.waiting.pop()
            req.num_computed_tokens = hit
            self.stats.prefix_cache_queries += req.num_tokens
            self.stats.prefix_cache_hits += hit
            if req.num_output_tokens == 0 and req.metrics.num_preemptions == 0:
                self.stats.num_prompt_tokens += req.num_prompt_tokens
                req.num_cached_tokens = hit
            self._admit(out, req, n)
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            budget -= n
        return budget

    def _allocate_new(self, req: Request, num_tokens: int, computed: list[int]) -> bool:
        """Blocks for a request leaving the waiting queue, on top of its cache-hit blocks
        ``computed``: prompt + max_tokens under reserve (only the blocks it still needs count),
        its first ``num_tokens`` under preempt. False (nothing held) when they do not fit."""
        rid = req.request_id
        if self.config.kv_policy is KVPolicy.RESERVE:
            need = blocks_for(req.max_total_tokens, self.block_size) - len(computed)
            if not self.kv.can_allocate(need, computed):
                return False
            self.kv.allocate_slots(rid, req.max_total_tokens, computed)
            return True
        slots = num_tokens
        if self.lookahead and num_tokens >= req.num_tokens:
            slots = min(num_tokens + self.lookahead, req.max_total_tokens)
        if self.kv.allocate_slots(rid, slots, computed) is not None:
            return True
        return slots > num_tokens and self.kv.allocate_slots(rid, num_tokens, computed) is not None

    def _admit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._admitted.add(req.request_id)
        self._take(out, req, n)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The adapters (names, first seen first) of the running requests and of the waiting
        ones (queued, swapped or waiting for a grammar): vLLM's ``running_lora_adapters`` and
        ``waiting_lora_adapters``."""
        running = {r.lora_request.lora_name: None for r in self.running if r.lora_request}
        queued = (*self.waiting, *self.swapped, *self.waiting_for_grammar)
        waiting = {r.lora_request.lora_name: None for r in queued if r.lora_request}
        return list(running), list(waiting)

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running, s.num_waiting, s.num_swapped = (
            len(self.running),
            len(self.waiting) + len(self.waiting_for_grammar),
            len(self.swapped),
        )
        s.kv_usage = self.kv.pool.usage()
