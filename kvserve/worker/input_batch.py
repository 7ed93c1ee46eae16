"""The runner's own state of each request it runs (vLLM's ``CachedRequestState`` /
``InputBatch``, without the persistent tensors: kvserve flattens its batch every step).

A request arrives once as ``NewRequestData``; later steps bring only its changes
(``CachedRequestData``: new tokens, the changed tail of its block table, its computed count).
``InputBatch.update`` applies a step's message and returns the step's rows in batch order.
Everything here is the runner's: the seeded generator (so a seeded request draws the same
noise whatever batch it is in, and across preemption), the output history that penalties,
min_tokens and custom logits processors read, and the prompt logprob entries computed so
far. A request's state lives until it finishes or is aborted (``finished_req_ids``); a
preempted request keeps it (vLLM's rule) and gets a new block table when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.core.scheduler_output import NewRequestData, SchedulerOutput
from kvserve.lora.request import LoRARequest
from kvserve.pooling_params import PoolingSpec
from kvserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """One request as the runner knows it (attribute names as ``Request``'s, so the pooler
    and prompt logprobs read either)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the scheduler's, appended from each step's message
    all_token_ids: list[int]  # prompt + output
    params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    pooling: PoolingSpec | None
    block_ids: list[int]  # its device block table
    num_computed_tokens: int
    # prompt logprob entries the engine holds ([None] counts 1); None: not asked
    num_prompt_logprobs: int | None
    generator: torch.Generator | None = field(default=None, repr=False)  # seeded requests
    lora_request: LoRARequest | None = None  # its adapter; None: the base model

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> CachedRequestState:
        generator = None
        seed = new.sampling_params.seed
        if seed is not None and new.pooling is None:
            generator = torch.Generator(device=device).manual_seed(seed)
        return cls(
            request_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            all_token_ids=[*new.prompt_token_ids, *new.output_token_ids],
            params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            max_tokens=new.max_tokens,
            pooling=new.pooling,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            num_prompt_logprobs=new.num_prompt_logprobs,
            generator=generator,
            lora_request=new.lora_request,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def structured(self) -> bool:
        """Grammar-constrained or with a thinking budget (its bitmask rows come with each
        step's message)."""
        p = self.params
        return p.structured_outputs is not None or p.thinking_token_budget is not None

    def min_tokens_stop_ids(self) -> list[int]:
        """Token ids masked while the output is shorter than ``min_tokens``: EOS (unless
        ignore_eos) and the stop token ids."""
        p = self.params
        if self.num_output_tokens >= p.min_tokens:
            return []
        return [*([] if p.ignore_eos else self.eos_token_ids), *(p.stop_token_ids or [])]


@dataclass
class StepRows:
    """One step's rows, in batch order, as the runner's states (what ``SchedulerOutput``
    gives the scheduler: the same questions, answered from the runner's own data)."""

    scheduled: list[CachedRequestState]
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]

    def samples(self, req: CachedRequestState) -> bool:
        """The step reaches the end of the request's tokens: it gets new tokens."""
        return req.pooling is None and self._reaches_end(req)

    def pools(self, req: CachedRequestState) -> bool:
        """The step completes an embedding request's prompt: its vector is returned."""
        return req.pooling is not None and self._reaches_end(req)

    def _reaches_end(self, req: CachedRequestState) -> bool:
        return req.num_computed_tokens + self.num_scheduled_tokens[req.request_id] >= req.num_tokens

    def num_spec_tokens(self, req: CachedRequestState) -> int:
        return len(self.scheduled_spec_decode_tokens.get(req.request_id, ()))

    def only(self, req: CachedRequestState) -> StepRows:
        """The same step with ``req`` alone (a failed batch is retried request by request)."""
        rid = req.request_id
        spec = self.scheduled_spec_decode_tokens
        return StepRows([req], {rid: self.num_scheduled_tokens[rid]},
                        {rid: spec[rid]} if rid in spec else {})  # fmt: skip


class InputBatch:
    """request id -> ``CachedRequestState``, kept in step with the step messages."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, sched: SchedulerOutput) -> StepRows:
        """Apply a step message (finished requests go, new ones come, the others change)
        and return the step's rows in the scheduler's order. Called once per message: a
        retried step reuses the rows it returned."""
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new, self.device)
        c = sched.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            st = self.requests.get(rid)
            if st is None:
                raise RuntimeError(f"the runner has no state for request {rid}")  # a bug
            new_tokens = c.new_token_ids[i]
            st.output_token_ids.extend(new_tokens)
            st.all_token_ids.extend(new_tokens)
            new_blocks = c.new_block_ids[i]
            if c.resumed_from_preemption[i]:
                st.block_ids = list(new_blocks)
            else:
                del st.block_ids[c.num_block_ids[i] - len(new_blocks) :]
                st.block_ids.extend(new_blocks)
            if len(st.block_ids) != c.num_block_ids[i]:
                raise RuntimeError(f"request {rid}: the runner's block table is out of step")
            st.num_computed_tokens = c.num_computed_tokens[i]
        rows = [self.requests[rid] for rid in sched.num_scheduled_tokens]
        return StepRows(rows, sched.num_scheduled_tokens, sched.scheduled_spec_decode_tokens)
