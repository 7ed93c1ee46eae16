"""The engine's front door: prompts to token ids, and the checks that a request can ever run
(vLLM's input ``Processor``). It reads the model's limits and the KV cache's size and
changes nothing; ``LLMEngine``, ``LLM`` and the async engine call it before a request is
queued, so bad input fails at once with a ``ValueError`` and never reaches a step.

A request is checked once: ``process`` (or ``validate`` on token ids) returns a
``ValidatedRequest``, which ``LLMEngine.add_validated`` admits on the engine thread without
checking again; the caller's ``SamplingParams`` are never written into."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.beam_search import BeamSearchParams
from kvserve.config import EngineConfig, ExecutorBackend, KVPolicy, SchedulingPolicy
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_for
from kvserve.engine.decoding_setup import validate_decoding_fields
from kvserve.pooling_params import PoolingParams, truncate_prompt
from kvserve.sampling_params import SEED_MAX, SEED_MIN, ParamError, SamplingParams, is_int

# A prompt: text, token ids, or vLLM's dict forms.
PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class ValidatedRequest:
    """A request checked against the model's real limits: what the engine admits as is."""

    prompt: str | None  # the prompt's text, when it had one
    prompt_token_ids: list[int]
    # The engine's own parameters: the caller's, or a copy carrying bad_words_token_ids
    params: SamplingParams | PoolingParams
    max_tokens: int  # resolved against the context and the KV cache; 0: an embedding request
    priority: int = 0
    # beam search (params: its placeholder); num_outputs: the best hypotheses returned
    beam_search: BeamSearchParams | None = None
    num_outputs: int = 1
    background: bool = False  # a Batch API line (Request.background)


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        hf_config: Any,
        max_model_len: int,
        kv: KVCacheManager,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = int(hf_config.vocab_size)
        self.hidden_size = int(hf_config.hidden_size)
        self.max_model_len = max_model_len
        # the runner lives in worker processes: what a request carries must pickle
        self._runner_elsewhere = config.parallel.distributed_executor_backend is (
            ExecutorBackend.MP
        )
        self.kv = kv  # read only: its capacity

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for any accepted prompt form; raises ValueError if bad."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of token ids")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send prompt_token_ids")
            try:
                return prompt, self.tokenizer.encode(prompt)
            except Exception as e:  # e.g. a lone surrogate, which no tokenizer can encode
                raise ValueError(f"the prompt cannot be tokenized: {e}") from e
        if isinstance(prompt, list) and all(is_int(t) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def tokenize_for_pooling(
        self, prompt: PromptType, params: PoolingParams
    ) -> tuple[str | None, list[int]]:
        """An embedding request's (text, token ids): ``tokenize_prompt``, then only the last
        ``truncate_prompt_tokens`` tokens (the text is dropped when the prompt is cut)."""
        text, ids = self.tokenize_prompt(prompt)
        cut = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        return (text if len(cut) == len(ids) else None), cut

    def process(
        self, prompt: PromptType, params: SamplingParams | PoolingParams, priority: int = 0
    ) -> ValidatedRequest:
        """Tokenize ``prompt`` (an embedding request's cut to ``truncate_prompt_tokens``) and
        ``validate`` it. Raises ValueError."""
        if isinstance(params, PoolingParams):
            text, ids = self.tokenize_for_pooling(prompt, params)
        else:
            text, ids = self.tokenize_prompt(prompt)
        return self.validate(ids, params, priority, text)

    def validate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        text: str | None = None,
    ) -> ValidatedRequest:
        """Check a request can ever run, with the model's real limits (every token id inside
        the vocabulary): the one check a request gets (its max_tokens resolved; 0 for an
        embedding request, which ``PoolingParams`` make). Raises ValueError."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not (is_int(t) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is out of the vocabulary (size {vocab})")
        if isinstance(params, PoolingParams):
            self._validate_pooling(n, params, priority)
            return ValidatedRequest(text, list(prompt_ids), params, 0, priority)
        bad = [t for t in params.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is out of the vocabulary (size {vocab})"
            )
        self._check_priority(priority)
        check_max_logprobs(params, self.config.model.max_logprobs, vocab)
        bad_words = validate_decoding_fields(params, self.tokenizer, vocab)
        for cls in self.config.model.logits_processors:
            cls.validate_params(params)  # a custom processor may refuse the request
        if params.logits_processors and self._runner_elsewhere:
            raise ParamError(
                "logits_processors",
                "per-request logits_processors (Python callables) cannot be sent to the "
                "worker processes of distributed_executor_backend 'mp'; use a batch-level "
                "processor class (--logits-processors), which each worker builds itself",
            )
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                f"tokens, which leaves no room to generate"
            )
        capacity = self.kv.num_tokens_capacity
        room = min(self.max_model_len, capacity) - n
        max_tokens = min(params.max_tokens, self.max_model_len - n) if params.max_tokens else room
        if (
            max_tokens < 1
            or blocks_for(n + max_tokens, self.kv.block_size) > self.kv.pool.num_blocks
        ):
            raise ValueError(
                f"the request needs {n} prompt + {max_tokens or 1} output tokens but the KV cache "
                f"holds only {capacity} tokens ({self.kv.pool.num_blocks} blocks); it can never "
                f"fit: raise kv_cache_memory / num_kv_blocks or lower max_tokens"
            )
        if bad_words:  # the engine's own copy: the caller's parameters stay as given
            params = copy.copy(params)
            params.bad_words_token_ids = bad_words
        return ValidatedRequest(text, list(prompt_ids), params, max_tokens, priority)

    def validate_beam_search(
        self,
        prompt_ids: list[int],
        params: BeamSearchParams,
        text: str | None = None,
        num_outputs: int | None = None,
        priority: int = 0,
    ) -> ValidatedRequest:
        """Check a beam search can ever run: the prompt as ``validate`` does, the width
        against ``--max-beam-width``, and ``beam_width`` beams at their longest in the KV cache
        (the prompt's full blocks shared, everything else per beam). Raises ValueError."""
        if self.config.scheduler.kv_policy is KVPolicy.RESERVE:
            # a fork's blocks are its parent's: nothing was reserved for what it writes
            raise ValueError(
                "beam search needs kv_policy 'preempt' (--kv-policy preempt): under 'reserve' "
                "the beams that fork have no reserved blocks"
            )
        cap = self.config.model.max_beam_width
        if params.beam_width > cap:
            raise ParamError(
                "beam_width",
                f"beam_width is {params.beam_width}, above the engine's limit of {cap} "
                f"(max_beam_width, --max-beam-width)",
            )
        num_outputs = num_outputs or params.beam_width
        if not 1 <= num_outputs <= params.beam_width:
            raise ParamError(
                "n", f"n ({num_outputs}) must be between 1 and the beam width ({params.beam_width})"
            )
        plain = SamplingParams(max_tokens=params.max_tokens, detokenize=False)
        req = self.validate(prompt_ids, plain, priority, text)
        n, bs, w = len(prompt_ids), self.kv.block_size, params.beam_width
        shared = n // bs
        need = shared + w * (blocks_for(n + req.max_tokens, bs) - shared)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"beam search with beam_width {w} and {req.max_tokens} output tokens on a "
                f"{n}-token prompt may hold {need} KV blocks but the KV cache has only "
                f"{self.kv.pool.num_blocks}; lower beam_width or max_tokens, or raise "
                f"kv_cache_memory / num_kv_blocks"
            )
        return ValidatedRequest(text, list(prompt_ids), plain, req.max_tokens, priority, params,
                                num_outputs)  # fmt: skip

    def _validate_pooling(self, n: int, params: PoolingParams, priority: int) -> None:
        """An embedding request's own limits: its prompt fills at most the whole context
        (nothing is generated after it) and the KV cache."""
        self._check_priority(priority)
        bad = [t for t in params.logit_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ParamError(
                "logit_token_ids",
                f"token id {bad[0]} is out of the vocabulary (size {self.vocab_size})",
            )
        size = self.hidden_size
        if params.dimensions is not None and params.dimensions != size:
            # vLLM shortens only Matryoshka-trained models; a decoder's hidden state is not one.
            raise ParamError(
                "dimensions",
                f"dimensions is {params.dimensions} but this model's embeddings have {size} "
                f"dimensions (its hidden size) and cannot be shortened; leave dimensions unset "
                f"or send {size}",
            )
        if n > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, more than the model's context of "
                f"{self.max_model_len} tokens; shorten it or set truncate_prompt_tokens"
            )
        if blocks_for(n, self.kv.block_size) > self.kv.pool.num_blocks:
            raise ValueError(
                f"the prompt has {n} tokens but the KV cache holds only "
                f"{self.kv.num_tokens_capacity} tokens ({self.kv.pool.num_blocks} blocks); it "
                f"can never fit: raise kv_cache_memory / num_kv_blocks"
            )

    def _check_priority(self, priority: int) -> None:
        if not is_int(priority) or not SEED_MIN <= priority <= SEED_MAX:
            raise ValueError(f"priority must be an int64 integer, got {priority!r}")
        policy = self.config.scheduler.scheduling_policy
        if priority != 0 and policy is not SchedulingPolicy.PRIORITY:
            # vLLM's rule: a priority that would be ignored is an error, not a silent no-op.
            raise ValueError(
                f"got priority {priority} but priority scheduling is not enabled "
                f"(scheduling_policy is {policy.value!r}; use --scheduling-policy priority)"
            )


def logprobs_over_cap(
    params: SamplingParams, max_logprobs: int, vocab_size: int
) -> tuple[str, int, int] | None:
    """(field, value, cap) of the first logprobs field above ``max_logprobs`` (vLLM's check;
    -1: the vocabulary), else None. Prompt logprobs count too: each prompt token's top-k is a
    full-vocabulary softmax and a k-entry dict in the answer, so ``prompt_logprobs`` on a
    long prompt is the costliest thing a small request can ask for."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > cap:
            return name, value, cap
    return None


def check_max_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """Raise ``ParamError`` naming the field when ``logprobs_over_cap`` finds one."""
    over = logprobs_over_cap(params, max_logprobs, vocab_size)
    if over is not None:
        name, value, cap = over
        raise ParamError(
            name,
            f"{name} is {value}, above the engine's limit of {cap} logprobs per token "
            f"(max_logprobs, --max-logprobs)",
        )
