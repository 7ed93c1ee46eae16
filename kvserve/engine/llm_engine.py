"""The synchronous engine: add requests, call ``step()``, collect ``RequestOutput``s.

One step = schedule -> (swap copies) -> forward -> sample -> scheduler update ->
detokenize / stop strings -> outputs. ``LLM`` (offline) and ``AsyncLLMEngine`` (server)
both drive this class. Two parts of the class sit beside it: ``step_output.py`` (the
output side of a step: failures, beams, logprobs, text, collected outputs) and
``engine_lora.py`` (the adapter registry); ``engine_setup.py`` reads the tokenizer and EOS
ids and writes the start-up lines.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from kvserve.config import EngineConfig, PoolingType
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.beam_search import BeamGroup, apply_forks
from kvserve.engine.engine_lora import LoRAMixin
from kvserve.engine.engine_setup import eos_token_ids, load_tokenizer, log_engine_start
from kvserve.engine.generation_defaults import sampling_defaults
from kvserve.engine.input_processor import InputProcessor, PromptType, ValidatedRequest
from kvserve.engine.output_processor import CompletionState, ParentRequest
from kvserve.engine.sleep_mode import EngineSleepingError, check_sleep
from kvserve.engine.step_output import StepOutputMixin
from kvserve.executor import Executor, create_executor
from kvserve.lora.request import LoRARequest
from kvserve.model.loader import load_hf_config
from kvserve.outputs import EngineOutput
from kvserve.pooling_params import PoolingParams, PoolingSpec
from kvserve.sampling_params import SamplingParams
from kvserve.scoring import resolve_scorer
from kvserve.structured_output.grammar import GrammarCompiler, StructuredOutputRequest
from kvserve.structured_output.reasoning import ReasoningState
from kvserve.worker.execution_paths import ExecutionPaths
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.model_setup import resolve_max_model_len
from kvserve.worker.runner_output import ModelRunnerOutput, StepTimings
from kvserve.worker.step_interrupt import StepInterrupt

__all__ = ["LLMEngine", "PromptType", "load_tokenizer"]

logger = logging.getLogger("kvserve")

# An embedding request's SamplingParams: never read, since it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


class LLMEngine(StepOutputMixin, LoRAMixin):
    """Owns the scheduler, the KV bookkeeping, the executor and every request's state."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(config.device)
        path = Path(mc.path)
        self.hf_config = load_hf_config(path)
        self.max_model_len = resolve_max_model_len(mc, self.hf_config)
        self.model_name = mc.served_name or path.name
        self.tokenizer = load_tokenizer(mc.tokenizer or path)
        # DecodeStream works on the Rust tokenizer behind the transformers wrapper.
        self._backend_tokenizer = self.tokenizer.backend_tokenizer if self.tokenizer else None
        self.eos_token_ids = eos_token_ids(path, self.tokenizer, self.hf_config)
        # The model's sampling defaults (--generation-config auto), vLLM's dict of the same name.
        self.default_sampling_params = sampling_defaults(
            path, mc.generation_config, dict(mc.source_sampling_defaults)
        )
        # The runner(s): in this process or one worker process per rank; each loads the
        # model, sizes and allocates the KV cache and warms up (ModelRunner(config, rank)).
        self.executor: Executor = create_executor(config)
        # The runner itself when it lives in this process (the default), else None.
        self.runner: ModelRunner | None = self.executor.runner
        # Steps of background rows (and of aborted requests' rows) give way to online requests
        # between layers; the async engine's threads set the flag, so only an in-process
        # runner can read it
        # (worker/step_interrupt.py; worker processes run every step to its end).
        self.step_interrupt = StepInterrupt()
        if self.runner is not None:
            self.runner.step_interrupt = self.step_interrupt
        info = self.executor.info
        self.warmup_tokens = info.warmup_tokens  # tokens of the start-up dummy prefill (0: none)
        self.kv = KVCacheManager(
            info.num_blocks, cc.block_size, info.num_swap_blocks, cc.enable_prefix_caching
        )
        max_loras = None if config.lora is None else config.lora.max_loras
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, config.speculative, max_loras)
        # LoRA adapters registered (add_lora), by name: what the server lists and resolves
        self.loras: dict[str, LoRARequest] = {}
        self._lora_removals: set[int] = set()  # removed while requests still used them
        self.processor = InputProcessor(
            config, self.tokenizer, self.hf_config, self.max_model_len, self.kv
        )
        self.timings = StepTimings()  # the engine's phases plus the runner's, per step
        self.kv_info = {
            "num_blocks": info.num_blocks,
            "block_size": cc.block_size,
            "num_tokens": info.num_blocks * cc.block_size,
            "bytes": info.num_blocks * info.bytes_per_block,
            "num_swap_blocks": info.num_swap_blocks,
        }
        log_engine_start(self.model_name, config, info)
        # sleep mode: 0 awake, else the level slept at; whether a request wakes it (idle sleep)
        self.sleep_level = 0
        self.wake_on_request = False
        # how /score, /rerank and LLM.score score a pair (kvserve/scoring.py)
        self.scorer = resolve_scorer(mc.task, self.hf_config, self.tokenizer)
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, ParentRequest] = {}
        self._child_state: dict[str, CompletionState] = {}
        self._beam_groups: dict[str, BeamGroup] = {}  # beam searches by the caller's id
        self._token_texts: dict[int, str] = {}  # token id -> text, for Logprob.decoded_token
        # Structured outputs; cheap to build (the compile workers and xgrammar's tokenizer
        # info start with the first grammar, or warm_up), built here so no two threads race.
        self._grammar: GrammarCompiler | None = None
        if self.tokenizer is not None:
            self._grammar = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured_outputs
            )

    @property
    def execution_paths(self) -> ExecutionPaths:
        """Rank 0's paths (fused ops, decode loop, kernel ISA, weight dtype, threads and their
        cores), read back in its process after loading: what benchmarks record."""
        return self.executor.info.paths

    @property
    def rank_execution_paths(self) -> list[ExecutionPaths]:
        """Every rank's paths, in rank order (each rank has its own cores)."""
        return [info.paths for info in self.executor.infos]

    def close(self) -> None:
        """Stop the runner(s): worker processes end (idempotent; also at exit)."""
        self.executor.shutdown()
        self.runner = None
        if self._grammar is not None:
            self._grammar.shutdown()  # its compile workers end

    # -- requests -----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters gets (vLLM's method): the model's
        defaults, and vLLM's for every field they do not set."""
        return SamplingParams(**self.default_sampling_params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (``n`` child sequences), or with ``PoolingParams`` an embedding
        request (vLLM's signature). ``priority``: lower runs first under the ``priority``
        scheduling policy; must be 0 otherwise. ``lora_request``: the adapter it runs with
        (added first if new). Raises ValueError for bad input (a bad adapter included)."""
        params = params or self.get_default_sampling_params()
        request = self.processor.process(prompt, params, priority)
        self.add_validated(request_id, request, arrival_time, lora_request)

    def add_validated(
        self,
        request_id: str,
        request: ValidatedRequest,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request the input processor has already checked (the async engine checks
        at the door, ``LLM`` before it queues anything): admitted as is, not checked again.
        ``lora_request``: the adapter it runs with (added first if new; a bad one raises)."""
        if request_id in self._parents or request_id in self._beam_groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.sleep_level:
            if not self.wake_on_request:
                raise EngineSleepingError(
                    f"the model {self.model_name!r} is sleeping (level {self.sleep_level}); "
                    "wake it first (POST /wake_up, LLM.wake_up())"
                )
            self.wake_up()  # an idle sleep: this request's time to first token pays it
        text, ids, params = request.prompt, request.prompt_token_ids, request.params
        if request.beam_search is not None:
            self._add_beam_search(request_id, request, arrival_time, lora_request)
            return
        max_tokens, priority = request.max_tokens, request.priority
        if lora_request is not None:
            if isinstance(params, PoolingParams):
                raise ValueError("embedding requests run the base model: no lora_request")
            self.add_lora(lora_request)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(
                request_id, text, ids, params, arrival_time, priority, request.background
            )
            return
        parent = ParentRequest(request_id, text, ids, params)
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Distinct but reproducible streams per completion, as vLLM does.
                child_params = dataclasses.replace(params, n=1, seed=params.seed + i)
                child_params.bad_words_token_ids = params.bad_words_token_ids
            grammar = self._constraints(child_params)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                cid, ids, child_params, max_tokens, self.eos_token_ids, arrival_time, priority,
                grammar, lora_request=lora_request, background=request.background,
            )  # fmt: skip
            stream = None
            if self.tokenizer is not None and params.detokenize:
                stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
            state = CompletionState(i, req, stream)
            if i > 0:
                req.prompt_logprobs = None  # the siblings' prompt is one: completion 0 reports it
            parent.children.append(state)
            self._child_parent[cid] = parent
            self._child_state[cid] = state
        self._parents[request_id] = parent
        for state in parent.children:
            self.scheduler.add_request(state.request)

    def _add_beam_search(
        self,
        request_id: str,
        request: ValidatedRequest,
        arrival_time: float | None,
        lora_request: LoRARequest | None,
    ) -> None:
        """A beam search: one first beam, which forks as the search goes (``BeamGroup``)."""
        assert request.beam_search is not None
        if lora_request is not None:
            self.add_lora(lora_request)
        group = BeamGroup(
            request_id, request.prompt, request.prompt_token_ids, request.beam_search,
            request.max_tokens, self.eos_token_ids, arrival_time, lora_request,
            request.num_outputs, request.priority, request.background,
        )  # fmt: skip
        self._beam_groups[request_id] = group
        self.scheduler.add_request(group.beams[0].request)

    def _add_pooling_request(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
        background: bool = False,
    ) -> None:
        """One prompt-only child that finishes after its prefill (max_tokens 0: it never
        samples; its SamplingParams are inert placeholders)."""
        spec = PoolingSpec(self.config.model.pooling, params.normalize)
        if params.logit_token_ids is not None:  # a reranker's score: the last position's
            spec = PoolingSpec(PoolingType.LAST, False, params.logit_token_ids)
        req = Request(
            request_id, ids, _NO_SAMPLING, 0, self.eos_token_ids, arrival_time, priority,
            pooling=spec, background=background,
        )  # fmt: skip
        parent = ParentRequest(request_id, text, ids, _NO_SAMPLING, pooling=params)
        state = CompletionState(0, req, None)
        parent.children.append(state)
        self._child_parent[request_id] = parent
        self._child_state[request_id] = state
        self._parents[request_id] = parent
        self.scheduler.add_request(req)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Cancel requests; their KV blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._beam_groups.pop(rid, None)
            if group is not None:
                group.abort(self.scheduler)
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            cids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(cids, RequestStatus.FINISHED_ABORTED)
            for cid in cids:
                self._child_parent.pop(cid, None)
                self._child_state.pop(cid, None)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler (xgrammar over this tokenizer and vocabulary)."""
        if self._grammar is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        return self._grammar

    def _constraints(self, params: SamplingParams) -> StructuredOutputRequest | None:
        """One sequence's token constraints: its grammar (applied after the thinking when the
        request has reasoning markers) and its thinking budget; None when it has neither."""
        so, markers = params.structured_outputs, params.reasoning_markers
        if so is None and params.thinking_token_budget is None:
            return None
        reasoning = None
        if markers is not None:
            reasoning = ReasoningState(markers, params.thinking_token_budget)
        if so is None:
            return StructuredOutputRequest(None, self.vocab_size, reasoning)
        return self.grammar_compiler.new_request(so, reasoning)

    def compile_grammar(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        """Start compiling the request's grammar (cached by its text); None when unconstrained.
        The future's exception is a ``GrammarError`` (a ``ValueError``) with the reason."""
        so = params.structured_outputs
        return None if so is None else self.grammar_compiler.compile(so)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (a request larger than this can never run)."""
        return self.kv.num_tokens_capacity

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def hidden_size(self) -> int:
        """The size of the final hidden states, so of every embedding."""
        return int(self.hf_config.hidden_size)

    def num_waiting(self) -> int:
        """Requests queued and not yet running (preempted-with-recompute ones and those
        waiting for their grammar included)."""
        return len(self.scheduler.waiting) + len(self.scheduler.waiting_for_grammar)

    def num_waiting_tokens(self) -> int:
        """Tokens of the queued requests (prompt plus any output of a preempted one)."""
        return sum(r.num_tokens for r in self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._beam_groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents) + len(self._beam_groups)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One engine step. A fault caused by one request's data fails that request alone
        (finish reason ``error``, ``RequestOutput.error`` says why); the others continue with
        the outputs they would have had. Raises ``EngineFaultError`` only when the engine
        itself is broken (see ``fault_isolation``)."""
        timings = self.timings
        t0 = time.perf_counter()
        if self._lora_removals:
            self._finish_lora_removals()
        sched = self.scheduler.schedule()
        timings.schedule += time.perf_counter() - t0
        if not sched.scheduled and self.scheduler.waiting_for_grammar:
            self._wait_for_grammars()
        out = self._execute(sched)
        if out.interrupted:  # given up for an online request: it is scheduled next step
            self.scheduler.discard_step(sched)
            return []
        t1 = time.perf_counter()
        failed_parents = self._fail_step(sched, out)
        forks, holds = self._beam_step(out)
        updated, finished = self.scheduler.update_from_output(
            sched, out.sampled, out.spec_token_ids
        )
        apply_forks(forks, holds, self.scheduler)
        # beams are the beam groups' requests: the text side below is for the others
        updated = [r for r in updated if r.request_id in self._child_state]
        self._add_prompt_results(out)
        now = time.monotonic()
        stopped, text_failed = self._update_outputs(updated, out, now)
        finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._record_finished(finished, now, text_failed)
        failed_parents += self._fail_requests(text_failed)
        parent_ids = dict.fromkeys(failed_parents)
        parent_ids.update((self._child_parent[r.request_id].request_id, None) for r in updated)
        outputs = self._collect(parent_ids)
        outputs += self._collect_beams()
        timings.output += time.perf_counter() - t1
        return outputs

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step on the runner(s); their phase times join the engine's."""
        out = self.executor.execute_model(sched)
        self.timings.add(out.timings)
        if out.timings:
            self.timings.steps += 1
        return out

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars compiling: wait for one (up to 10 ms) instead of
        spinning empty steps against the compile thread."""
        futures = [
            r.structured_output.grammar
            for r in self.scheduler.waiting_for_grammar
            if r.structured_output is not None
        ]
        concurrent.futures.wait(futures, timeout=0.01, return_when="FIRST_COMPLETED")

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``); returns how many
        blocks were dropped. Running requests are not affected."""
        return self.kv.reset_prefix_cache()

    # -- sleep mode (kvserve/engine/sleep_mode.py) ---------------------------------------------
    def sleep(self, level: int = 1, wake_on_request: bool = False) -> float:
        """Free the KV cache (level 1) and the weights (level 2) of every rank (vLLM's
        ``sleep``); returns the seconds it took. ``wake_on_request``: the next request wakes
        the engine (idle sleep) instead of being refused with ``EngineSleepingError``.
        Raises ValueError (mode off, bad level) or ``SleepRefusedError`` (requests running)."""
        level = check_sleep(self.config, level, self.get_num_unfinished_requests())
        # an explicit sleep wins over an idle one: requests are then refused until wake_up
        self.wake_on_request = wake_on_request and (self.wake_on_request or not self.sleep_level)
        if level <= self.sleep_level:
            return 0.0  # as deep already
        t0 = time.perf_counter()
        self.kv.reset_prefix_cache()  # the cached blocks' K/V is about to go
        self.executor.collective_rpc("sleep", level)
        self.sleep_level = level
        elapsed = time.perf_counter() - t0
        then = "the next request wakes it" if self.wake_on_request else "wake_up to serve"
        logger.info("%s asleep at level %d in %.2fs (%s)", self.model_name, level, elapsed, then)
        return elapsed

    def wake_up(self) -> float:
        """Allocate the KV cache again, reading the weights first after a level-2 sleep
        (vLLM's ``wake_up``); returns the seconds it took (0 when awake)."""
        if not self.sleep_level:
            return 0.0
        t0 = time.perf_counter()
        self.executor.collective_rpc("wake_up")
        level, self.sleep_level = self.sleep_level, 0
        elapsed = time.perf_counter() - t0
        logger.info("%s woke from sleep level %d in %.2fs", self.model_name, level, elapsed)
        return elapsed

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def stats(self) -> dict[str, Any]:
        """Totals and the current batch state (plain numbers, for users and /metrics)."""
        s = dataclasses.asdict(self.scheduler.stats)
        s["num_kv_blocks"] = self.kv.pool.num_blocks
        s["num_free_kv_blocks"] = self.kv.pool.num_free_blocks
        s["step_time"] = self.timings.as_dict()
        if self.config.lora is not None:  # vLLM's lora_requests_info labels
            running, waiting = self.scheduler.lora_adapters()
            s["lora"] = {"running": running, "waiting": waiting, "updated": time.time(),
                         "max_lora": self.config.lora.max_loras}  # fmt: skip
        return s
