"""What the scheduler hands the runner each step, and the scheduler's plain counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.core.request import Request


@dataclass
class SchedulerOutput:
    """What the runner executes this step."""

    scheduled: list[Request]  # requests computed this step, in batch order
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    block_tables: dict[str, list[int]]  # request id -> its device block ids, in order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted_req_ids: list[str] = field(default_factory=list)  # preempted during this step
    # Structured outputs: int32 [G, ceil(V / 32)] allowed-token bits for the constrained
    # requests that sample this step, and request id -> its row (vLLM's grammar_bitmask)
    grammar_bitmask: torch.Tensor | None = None
    structured_output_rows: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: request id -> the proposed tokens this step verifies (they follow
    # the request's tokens in its scheduled count; vLLM's scheduled_spec_decode_tokens)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose: bool = False  # speculative decoding: propose the next step's tokens after this one
    # requests that finished or were aborted since the last step (runner-side state goes)
    finished_req_ids: set[str] = field(default_factory=set)

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
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests, total
    num_generation_tokens: int = 0  # tokens sampled, total
    num_steps: int = 0  # engine steps that computed anything
    max_num_running: int = 0  # the most requests that ran in one step
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (not computed again)
    # Speculative decoding (vLLM's spec_decode_* counters): verified proposals (one per
    # request per step that had any), their tokens, how many were accepted, and accepted
    # tokens by position in the proposal (index 0 = the first proposed token)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
