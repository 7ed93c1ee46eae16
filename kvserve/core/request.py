"""The engine's view of one sequence being generated."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from kvserve.config import PoolingType
from kvserve.outputs import PromptLogprobs, RequestMetrics, TokenLogprobs
from kvserve.pooling_params import PoolingSpec
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.lora.request import LoRARequest
    from kvserve.structured_output.grammar import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, not yet admitted (or preempted with recompute)
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued while its grammar compiles
    RUNNING = "running"  # in the running batch, holding device blocks
    SWAPPED = "swapped"  # preempted with its blocks in CPU swap space
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # cancelled by the caller
    FINISHED_ERROR = "error"  # the engine failed on this request's data; others unaffected

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class Request:
    """Token state of one sequence. ``num_computed_tokens`` counts tokens whose KV is cached."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: list[int],
        arrival_time: float | None = None,
        priority: int = 0,
        structured_output: StructuredOutputRequest | None = None,
        pooling: PoolingSpec | None = None,
        lora_request: LoRARequest | None = None,
        background: bool = False,
    ) -> None:
        self.request_id = request_id
        # A Batch API line: it runs only in the room online requests leave (its running rows
        # sit out any step that prefills an online request; scheduler.py)
        self.background = background
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        self.priority = priority  # lower runs first under SchedulingPolicy.PRIORITY
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: the request param capped by the context
        self.eos_token_ids = eos_token_ids
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, appended per step
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first admitted
        # Speculative decoding: tokens proposed after the last one, verified by the next step
        # that schedules them (vLLM's spec_token_ids); never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        self.num_new_tokens = 0  # output tokens the last scheduler update appended (0..k+1)
        self.status = RequestStatus.WAITING
        # The grammar's matcher when the output is constrained (structured outputs), else None
        self.structured_output = structured_output
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time or time.monotonic())
        self.logprobs: list[TokenLogprobs] = []  # per output token, when asked for
        self.cumulative_logprob = 0.0
        # With params.prompt_logprobs: one entry per prompt token computed so far (the first is
        # None), appended by the engine; the runner computes only the missing ones, so a
        # recompute after preemption adds nothing twice. None: not asked (or an n > 1 sibling
        # that leaves them to completion 0).
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # An embedding request (max_tokens 0): it finishes when its prompt is computed, its
        # final hidden states pooled by the runner; it never samples. None: generation.
        self.pooling = pooling

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0: the base model (vLLM's convention)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_keys(self) -> tuple[object, ...]:
        """Extra keys of its prefix-cache block hashes: K/V computed under an adapter is
        never served to the base model or another adapter (vLLM's LoRA extra keys)."""
        return () if self.lora_request is None else self.lora_request.cache_key

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including the proposed ones: what a step may compute up to."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """True while prompt logprobs are still missing: cached positions have no logits, so
        such a request computes its whole prompt (vLLM skips the cache for them too). Mean
        pooling likewise needs the hidden state of every prompt position; last pooling only
        needs the last one, which a cache hit never covers."""
        if self.pooling is not None and self.pooling.type is PoolingType.MEAN:
            return True
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request can ever hold: what the reserve policy sets aside."""
        return self.num_prompt_tokens + self.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.structured_output is not None:
            # A refused token sets structured_output.error; the engine fails the request.
            self.structured_output.accept_tokens([token_id])

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first ``num_output_tokens`` (a stop string ended
        the text inside a speculative run; the request is finishing)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop :]
        for entry in self.logprobs[num_output_tokens:]:
            self.cumulative_logprob -= next(iter(entry.values())).logprob  # the token's own
        del self.logprobs[num_output_tokens:]
        self.num_new_tokens -= drop

    def check_stop(self) -> RequestStatus | None:
        """The finished status implied by the last token, or None to keep going (called after
        each appended token, so a stop inside an accepted speculative run ends it there)."""
        last = self.output_token_ids[-1]
        p = self.params
        if self.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in (p.stop_token_ids or ()):
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.structured_output is not None and self.structured_output.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar ended (its stop token was taken)
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
