"""What the scheduler hands the runner each step, and the scheduler's plain counters.

``SchedulerOutput`` is the step message. The runner reads only its plain fields: each request
it has not seen yet arrives once as a ``NewRequestData`` (prompt, params, blocks), after that
only what changed arrives, in ``CachedRequestData`` (vLLM v1's shapes; nano-vllm's
``Sequence.__getstate__`` is the small version). The runner keeps the rest in its own
``InputBatch`` (``kvserve/worker/input_batch.py``). ``scheduled`` (the live ``Request``s) and
``block_tables`` (every full table) are the scheduler's own view, for ``update_from_output``
and tests; pickling leaves them out, so nothing live crosses to a worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.core.request import Request
from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingSpec
from kvserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: sent once, the first step that schedules it."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # empty unless the request had output before (never today)
    # the request's sampling parameters (seed, penalties, bad_words_token_ids, logprobs...);
    # an embedding request's are inert placeholders
    sampling_params: SamplingParams
    eos_token_ids: list[int]  # masked while output < min_tokens (unless ignore_eos)
    max_tokens: int  # resolved max_tokens (speculative proposals never reach past it)
    pooling: PoolingSpec | None  # an embedding request: how to pool; None: generation
    block_ids: list[int]  # its device block table
    num_computed_tokens: int  # tokens whose K/V is already there (a prefix-cache hit)
    # prompt logprob entries the engine already holds ([None] counts 1); None: not asked
    num_prompt_logprobs: int | None
    lora_request: LoRARequest | None = None  # its adapter (the runner loads it); None: base

    @classmethod
    def from_request(cls, req: Request, block_ids: list[int]) -> NewRequestData:
        lps = req.prompt_logprobs
        return cls(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.params,
            eos_token_ids=req.eos_token_ids,
            max_tokens=req.max_tokens,
            pooling=req.pooling,
            block_ids=list(block_ids),
            num_computed_tokens=req.num_computed_tokens,
            num_prompt_logprobs=None if lps is None else len(lps),
            lora_request=req.lora_request,
        )


@dataclass
class CachedRequestData:
    """Requests the runner already holds: what changed since it last heard of them, as
    parallel lists (vLLM's layout; one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # back from preemption (recompute, or swap to new device blocks): new_block_ids is its
    # whole table; its sampling state (seeded generator, history) carries on
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # tokens the scheduler appended since the last message: the scheduler is the source of
    # truth (a stop, a stop string or a refused grammar token cuts a run the runner sampled)
    new_token_ids: list[list[int]] = field(default_factory=list)
    # block ids to append, after cutting the table to num_block_ids - len(new): blocks that
    # held only rejected speculative positions may have been released (resumed: the table)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_block_ids: list[int] = field(default_factory=list)  # the table's length afterwards
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(
        self,
        req_id: str,
        resumed: bool,
        new_token_ids: list[int],
        new_block_ids: list[int],
        num_block_ids: int,
        num_computed_tokens: int,
    ) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_block_ids.append(num_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    """What the runner executes this step."""

    # The scheduler's own view (engine process only; not pickled): the live requests in
    # batch order and each one's full block table.
    scheduled: list[Request]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step, in batch order
    block_tables: dict[str, list[int]]  # request id -> its device block ids, in order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted during this step
    # copy-on-write of blocks shared with a forked beam (src, dst), done after the swaps
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: int32 [G, ceil(V / 32)] allowed-token bits for the constrained
    # requests that sample this step, and request id -> its row (vLLM's grammar_bitmask)
    grammar_bitmask: torch.Tensor | None = None
    structured_output_rows: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: request id -> the proposed tokens this step verifies (they follow
    # the request's tokens in its scheduled count; vLLM's scheduled_spec_decode_tokens)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose: bool = False  # speculative decoding: propose the next step's tokens after this one
    # No online request waiting: the runner may give the step up between layers for an
    # online request that arrives, once every row in online_ids was aborted (none for a
    # background-only step; worker/step_interrupt.py)
    interruptible: bool = False
    online_ids: frozenset[str] = frozenset()  # the scheduled rows that are not background
    # requests that finished or were aborted since the last step (runner-side state goes)
    finished_req_ids: set[str] = field(default_factory=set)
    # The runner's input: requests it sees for the first time, and the changes of the others
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a worker process: the plain fields only (see the module docstring)."""
        state = dict(self.__dict__)
        state["scheduled"] = []
        state["block_tables"] = {}
        return state

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def samples(self, req: Request) -> bool:
        """True when this step reaches the end of the request's tokens (and computes any
        proposed tokens after them), so it gets at least one new token. Never for an
        embedding request (see ``pools``)."""
        return req.pooling is None and self._reaches_end(req)

    def pools(self, req: Request) -> bool:
        """True when this step computes the rest of an embedding request's prompt: the runner
        returns its pooled hidden states and the request finishes."""
        return req.pooling is not None and self._reaches_end(req)

    def _reaches_end(self, req: Request) -> bool:
        return req.num_computed_tokens + self.num_scheduled_tokens[req.request_id] >= req.num_tokens

    def num_spec_tokens(self, req: Request) -> int:
        """Proposed tokens this step verifies for ``req`` (0 without speculation)."""
        return len(self.scheduled_spec_decode_tokens.get(req.request_id, ()))


@dataclass
class SchedulerStats:
    """Plain counters; the server turns them into Prometheus metrics."""

    num_running: int = 0  # requests in the running batch after the last schedule()
    num_waiting: int = 0  # requests queued (including those preempted with recompute)
    num_swapped: int = 0  # requests whose KV sits in CPU swap space
    kv_usage: float = 0.0  # fraction of device KV blocks in use
    num_preemptions: int = 0  # total preemptions since start
    # background (Batch API) rows held out of steps that computed an online prompt, total
    num_background_rows_held: int = 0
    # background-only steps given up between layers for an online request, total
    num_background_steps_interrupted: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests, total
    num_generation_tokens: int = 0  # tokens sampled, total
    num_steps: int = 0  # engine steps that computed anything
    max_num_running: int = 0  # the most requests that ran in one step
    # steps by how many requests ran in them ({batch size: steps}): /metrics' histogram
    # step_num_requests_running, whose deltas give a benchmark its exact peak batch
    num_steps_by_running: dict[int, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed again)
    # Speculative decoding (vLLM's spec_decode_* counters): verified proposals (one per
    # request per step that had any), their tokens, how many were accepted, and accepted
    # tokens by position in the proposal (index 0 = the first proposed token)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
