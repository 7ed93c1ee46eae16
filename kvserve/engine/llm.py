"""Offline batch inference with vLLM's interface: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.input_processor import ValidatedRequest
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.lora.request import LoRARequest
from kvserve.outputs import (
    EmbeddingRequestOutput,
    EngineOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.scoring import finish_scores, pair_up, plan_scores
from kvserve.worker.execution_paths import ExecutionPaths

ChatMessages = list[dict[str, Any]]


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """``EngineArgs(model, **kwargs).create_engine_config()``: the options are declared in
    ``kvserve.engine.arg_utils``; kept for code that builds an ``LLMEngine`` directly."""
    return EngineArgs.from_kwargs(model, **kwargs).create_engine_config()


class LLM:
    """An engine for offline generation. ``model=None`` serves the built-in SmolLM2 model.

    ``kwargs`` are ``EngineArgs`` fields (vLLM's names where they carry over); an unknown
    one raises ``TypeError`` naming it.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model, **kwargs)
        # num_threads / cpu_cores: the engine sets torch's threads and their cores (each
        # worker its own, kvserve/worker/cpu_binding.py)
        self.engine = LLMEngine(args.create_engine_config())
        self._ids = itertools.count()

    @property
    def execution_paths(self) -> ExecutionPaths:
        """The paths the engine took (rank 0's): ``LLMEngine.execution_paths``."""
        return self.engine.execution_paths

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` and ``chat`` use when given none (vLLM's method): the
        model's generation_config.json values under ``generation_config="auto"`` (the
        default), vLLM's neutral ones for the rest."""
        return self.engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in the order given.

        ``priority``: one value per prompt, lower runs first (needs
        ``scheduling_policy="priority"``). ``lora_request``: the adapter of every prompt, or
        one per prompt (None: the base model); needs ``enable_lora=True``. A request the
        engine fails on (never expected: input is validated first) comes back with finish
        reason ``error`` and ``RequestOutput.error`` set; the other requests are not affected.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        loras = _lora_list(lora_request, len(prompts))
        # Tokenize and validate everything first (once), so a bad prompt leaves nothing
        # half-queued.
        process = self.engine.processor.process
        checked = [
            process(p, sp, prio)
            for p, sp, prio in zip(prompts, params_list, priorities, strict=True)
        ]
        for sp in params_list:
            grammar = self.engine.compile_grammar(sp)
            if grammar is not None:
                grammar.result()  # raises GrammarError (a ValueError) with the compiler's reason
        for lr in dict.fromkeys(r for r in loras if r is not None):
            self.engine.add_lora(lr)  # a bad adapter raises before anything is queued
        return self._run(checked, use_tqdm, loras)  # type: ignore[return-value]

    # -- LoRA adapters (vLLM's LLMEngine methods, here on LLM too) ---------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order given (vLLM's ``LLM.embed``): the final
        hidden states pooled as the engine's ``pooling`` says (last token or mean) and
        L2-normalised unless ``pooling_params.normalize`` is False. The prompts go through
        the same scheduler as generation, batched, and finish after their prefill.
        ``truncate_prompt_tokens``: keep each prompt's last k tokens (-1: the context)."""
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(params.normalize, params.dimensions, truncate_prompt_tokens)
        prompts = _prompt_list(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        process = self.engine.processor.process
        checked = [process(p, params, prio) for p, prio in zip(prompts, priorities, strict=True)]
        return self._run(checked, use_tqdm)  # type: ignore[return-value]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_tqdm: bool = True,
        instruction: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (vLLM's ``LLM.score``): ``text_1`` and ``text_2`` pair 1 to
        1, 1 to N or N to N. The engine's scorer (``kvserve/scoring.py``) is the cosine of
        the two texts' embeddings, or with ``task="score"`` (or a reranker's config) a
        causal-LM reranker's P(yes) over its yes/no logits, each pair in its template
        (``instruction`` replaces the template's default one)."""
        scorer = self.engine.scorer
        pairs = pair_up(text_1, text_2)
        plan = plan_scores(scorer, pairs, instruction)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer; score needs text")
        process = self.engine.processor.process
        checked = [
            process(
                {
                    "prompt": t,
                    "prompt_token_ids": tok.encode(t, add_special_tokens=plan.add_special_tokens),
                },
                plan.params,
            )
            for t in plan.texts
        ]
        outs = self._run(checked, use_tqdm)
        vectors = [o.outputs.embedding for o in outs]  # type: ignore[union-attr]
        scores = finish_scores(scorer, plan, vectors)
        return [
            ScoringRequestOutput(
                f"score-{next(self._ids)}",
                checked[i].prompt_token_ids + (checked[j].prompt_token_ids if j != i else []),
                ScoringOutput(score),
            )
            for (i, j), score in zip(plan.pairs, scores, strict=True)
        ]

    # -- sleep mode (vLLM's; needs enable_sleep_mode=True) -------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the KV cache and the weights (level 2) until
        ``wake_up``; requests in between raise ``EngineSleepingError``."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Allocate the KV cache again (and read the weights again after level 2)."""
        self.engine.wake_up()

    def _run(
        self,
        requests: list[ValidatedRequest],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[EngineOutput]:
        """Queue the checked requests (not checked again) and step until all are done."""
        ids = [f"offline-{next(self._ids)}" for _ in requests]
        done: dict[str, EngineOutput] = {}
        lrs = loras or [None] * len(requests)
        try:
            for rid, request, lr in zip(ids, requests, lrs, strict=True):
                self.engine.add_validated(rid, request, lora_request=lr)
            with tqdm(
                total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
            ) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        finally:
            # An interrupt (or any error) must not leave requests holding KV blocks.
            self.engine.abort_request([r for r in ids if r not in done])
        return [done[r] for r in ids]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt, the ``beam_width`` best hypotheses, best
        first by ``cum_logprob / len ** length_penalty`` (len counts the prompt, not a final
        EOS); each sequence's ``tokens`` are the prompt's then the generated ones and its
        ``text`` decodes them all (vLLM's shape). The beams of one prompt share its KV blocks
        (``engine/beam_search.py``)."""
        prompts = _prompt_list(prompts)
        loras = _lora_list(lora_request, len(prompts))
        proc = self.engine.processor
        checked = []
        for p in prompts:
            text, ids = proc.tokenize_prompt(p)
            checked.append(proc.validate_beam_search(ids, params, text))
        for lr in dict.fromkeys(r for r in loras if r is not None):
            self.engine.add_lora(lr)
        results = self._run(checked, use_tqdm, loras)
        tok = self.engine.tokenizer
        outputs = []
        for res in results:
            assert isinstance(res, RequestOutput)
            if res.error is not None:
                raise RuntimeError(f"beam search failed: {res.error}")
            seqs = []
            for c in res.outputs:
                tokens = [*res.prompt_token_ids, *c.token_ids]
                seqs.append(BeamSearchSequence(
                    tokens=tokens, logprobs=c.logprobs or [],
                    cum_logprob=c.cumulative_logprob or 0.0,
                    text=tok.decode(tokens) if tok is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                ))  # fmt: skip
            outputs.append(BeamSearchOutput(seqs))
        return outputs

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate. The template is
        ``chat_template``, else the engine's (``--chat-template``), else the tokenizer's."""
        tok = self.engine.tokenizer
        chat_template = chat_template or self.engine.config.model.chat_template
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: vLLM's single-or-list argument."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
    for lr in loras:
        if lr is not None and not isinstance(lr, LoRARequest):
            raise TypeError(f"lora_request entries must be LoRARequest or None, got {lr!r}")
    return loras


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
