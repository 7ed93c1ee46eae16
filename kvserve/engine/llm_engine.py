"""The synchronous engine: add requests, call ``step()``, collect ``RequestOutput``s.

One step = schedule -> (swap copies) -> forward -> sample -> scheduler update ->
detokenize / stop strings -> outputs. ``LLM`` (offline) and ``AsyncLLMEngine`` (server)
both drive this class.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import EngineConfig, PoolingType
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.beam_search import BeamGroup, apply_forks
from kvserve.engine.fault_isolation import EngineFaultError, engine_works
from kvserve.engine.generation_defaults import sampling_defaults
from kvserve.engine.input_processor import InputProcessor, PromptType, ValidatedRequest
from kvserve.engine.output_processor import (
    CompletionState,
    ParentRequest,
    TokenDecoder,
    add_prompt_logprobs,
    token_logprobs,
    update_text,
)
from kvserve.engine.sleep_mode import EngineSleepingError, check_sleep
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

logger = logging.getLogger("kvserve")

# An embedding request's SamplingParams: never read, since it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _eos_ids(path: Path, tokenizer: PreTrainedTokenizerBase | None, hf_config: Any) -> list[int]:
    gen = path / "generation_config.json"
    eos: Any = None
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


class LLMEngine:
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
        self.eos_token_ids = _eos_ids(path, self.tokenizer, self.hf_config)
        # The model's sampling defaults (--generation-config auto), vLLM's dict of the same name.
        self.default_sampling_params = sampling_defaults(
            path, mc.generation_config, dict(mc.source_sampling_defaults)
        )
        # The runner(s): in this process or one worker process per rank; each loads the
        # model, sizes and allocates the KV cache and warms up (ModelRunner(config, rank)).
        self.executor: Executor = create_executor(config)
        # The runner itself when it lives in this process (the default), else None.
        self.runner: ModelRunner | None = self.executor.runner
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
        logger.info(
            "loaded %s in %.1fs (%s executor, %d rank(s)); KV cache: %d blocks x %d tokens = "
            "%d tokens, %.1f MiB; attention backend: %s; fused ops: %s; C++ decode loop: %s%s",
            self.model_name,
            info.load_seconds,
            config.parallel.distributed_executor_backend.value,  # type: ignore[union-attr]
            config.parallel.world_size,
            info.num_blocks,
            cc.block_size,
            info.num_blocks * cc.block_size,
            info.num_blocks * info.bytes_per_block / 2**20,
            info.attention_backend,
            "on" if info.fused_ops else "off",
            "on" if info.decode_loop else "off",
            f"; CUDA graphs: {len(info.paths.cuda_graphs)} decode batch sizes up to "
            f"{info.paths.cuda_graphs[-1]}"
            if info.paths.cuda_graphs
            else "",
        )
        paths = info.paths
        logger.info(
            "execution paths: CPU capability %s, %s math, %s weights, %d thread(s) per rank, "
            "OpenMP threads on cores %s, OMP_WAIT_POLICY %s",
            paths.cpu_capability, paths.dtype, paths.weight_dtype, paths.num_threads,
            "|".join(",".join(map(str, c)) for c in paths.thread_cores) or "(unknown)",
            paths.omp_wait_policy or "unset",
        )  # fmt: skip
        if paths.batch_invariant:
            logger.info("batch-invariant mode: on (each row in a fixed order: linears, "
                        "attention per query on CPU_KERNEL, norms, sampling)")  # fmt: skip
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

    # -- LoRA adapters --------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and read it into the runners' host memory (vLLM's
        ``add_lora``); False if it was registered already. Raises ValueError with the reason
        (LoRA off, a name or id taken by another adapter, a bad adapter)."""
        if self.config.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora=True "
                             "(--enable-lora)")  # fmt: skip
        known = self.loras.get(lora_request.lora_name)
        if known == lora_request:
            return False
        if known is not None:
            raise ValueError(f"a LoRA adapter named {lora_request.lora_name!r} is already "
                             f"loaded (id {known.lora_int_id}, {known.lora_path})")  # fmt: skip
        for other in self.loras.values():
            if other.lora_int_id == lora_request.lora_int_id:
                raise ValueError(f"lora_int_id {other.lora_int_id} is already adapter "
                                 f"{other.lora_name!r}")  # fmt: skip
        self.executor.collective_rpc("add_lora", lora_request)
        self.loras[lora_request.lora_name] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): new requests can no longer name it;
        requests already queued or running on it finish on it. False if unknown."""
        name = next((n for n, r in self.loras.items() if r.lora_int_id == lora_int_id), None)
        if name is None:
            return False
        del self.loras[name]
        if not any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            self.executor.collective_rpc("remove_lora", lora_int_id)
        else:  # queued requests still need it: the runner forgets it after the last one
            self._lora_removals.add(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        """The registered adapters' ids (vLLM's ``list_loras``)."""
        return {r.lora_int_id for r in self.loras.values()}

    def _finish_lora_removals(self) -> None:
        """Removed adapters whose last request is gone leave the runners' memory."""
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        for lid in [i for i in self._lora_removals if i not in in_use]:
            self._lora_removals.discard(lid)
            if lid not in self.list_loras():  # not added again meanwhile
                self.executor.collective_rpc("remove_lora", lid)

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
        t1 = time.perf_counter()
        grammar_failed = {
            r.request_id: r.structured_output.error or "grammar failed"
            for r in self.scheduler.take_grammar_failures()
            if r.structured_output is not None
        }
        failed_parents = self._fail_requests(grammar_failed)
        failed_parents += self._fail_requests(out.failed)
        all_failed = bool(out.failed) and len(out.failed) == len(sched.scheduled)
        if all_failed and not engine_works(self.executor, self.kv):
            raise EngineFaultError(f"every request of the step failed: {out.failed}")
        self._fail_beams(out.failed)
        forks, holds = self._beam_step(out)
        updated, finished = self.scheduler.update_from_output(
            sched, out.sampled, out.spec_token_ids
        )
        apply_forks(forks, holds, self.scheduler)
        # beams are the beam groups' requests: the text side below is for the others
        updated = [r for r in updated if r.request_id in self._child_state]
        for rid, (first, entries) in out.prompt_logprobs.items():
            if (st := self._child_state.get(rid)) is not None:
                add_prompt_logprobs(st.request, first, entries, self._decoder(st.request.params))
        for rid, vector in out.pooled.items():
            if (parent := self._child_parent.get(rid)) is not None:
                parent.embedding = vector
        now = time.monotonic()
        stopped: list[str] = []
        text_failed: dict[str, str] = {}
        for req in updated:
            rid = req.request_id
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            self._add_logprobs(req, out)
            if req.structured_output is not None and req.structured_output.error:
                text_failed[rid] = req.structured_output.error
                continue
            try:
                hit = self._update_text(req)
            except Exception as exc:  # a token the tokenizer cannot decode, say
                text_failed[rid] = f"detokenizing failed: {exc!r}"
                continue
            if hit:
                if req.status.finished:
                    self.scheduler.restate_finished(req, RequestStatus.FINISHED_STOPPED)
                else:
                    stopped.append(rid)
        finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for req in finished:
            state = self._child_state[req.request_id]
            state.finish_reason = req.status.finish_reason
            if state.stop_reason is None:
                state.stop_reason = req.stop_reason
            req.metrics.finished_time = now
            if req.pooling is not None and self._child_parent[req.request_id].embedding is None:
                text_failed[req.request_id] = "the engine computed no embedding"  # a bug
        failed_parents += self._fail_requests(text_failed)
        parent_ids = dict.fromkeys(failed_parents)
        parent_ids.update((self._child_parent[r.request_id].request_id, None) for r in updated)
        outputs = self._collect(parent_ids)
        outputs += self._collect_beams()
        timings.output += time.perf_counter() - t1
        return outputs

    def _beam_step(self, out: ModelRunnerOutput) -> tuple[list, list[Request]]:
        """Every live beam search's decision for this step (see ``engine/beam_search.py``):
        ``out.sampled`` rewritten for its beams; returns the forks and holds to apply after
        the scheduler's update."""
        forks: list = []
        holds: list[Request] = []
        for group in self._beam_groups.values():
            for rid in group.beam_ids:
                # no proposals for beams: each step's token is the group's, not the runner's
                out.spec_token_ids.pop(rid, None)
            if not group.finished:
                f, h = group.step(out, out.sampled, self.scheduler)
                forks += f
                holds += h
        return forks, holds

    def _fail_beams(self, failed: dict[str, str]) -> list[str]:
        """Beam searches one of whose beams failed end with finish reason ``error``."""
        done = []
        for group in self._beam_groups.values():
            reason = next((failed[r] for r in group.beam_ids if r in failed), None)
            if reason is not None and not group.finished:
                logger.warning("beam search %s failed: %s", group.request_id, reason)
                group.fail(reason, self.scheduler)  # the others' samples are never appended
                done.append(group.request_id)
        return done

    def _collect_beams(self) -> list[EngineOutput]:
        """Outputs of the beam searches that finished this step (a search streams nothing)."""
        outputs: list[EngineOutput] = []
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        for rid in [r for r, g in self._beam_groups.items() if g.finished]:
            outputs.append(self._beam_groups.pop(rid).output(decode))
        return outputs

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step on the runner(s); their phase times join the engine's."""
        out = self.executor.execute_model(sched)
        self.timings.add(out.timings)
        if out.timings:
            self.timings.steps += 1
        return out

    def _add_logprobs(self, req: Request, out: ModelRunnerOutput) -> None:
        """Logprobs of the request's new tokens (one entry each), when it asked for them."""
        rid = req.request_id
        lps = out.sampled_logprob.get(rid)
        if lps is None:
            return
        tops, ranks = out.top_logprobs.get(rid, []), out.sampled_rank.get(rid, [])
        new = req.output_token_ids[len(req.output_token_ids) - req.num_new_tokens :]
        for j, token in enumerate(new):
            req.cumulative_logprob += lps[j]
            req.logprobs.append(
                token_logprobs(
                    token,
                    lps[j],
                    ranks[j] if j < len(ranks) else None,
                    tops[j] if j < len(tops) else {},
                    req.params.logprobs or 0,
                    self._decoder(req.params),
                )
            )

    def _update_text(self, req: Request) -> bool:
        """Detokenize the request's new tokens one by one; True when a stop string matched,
        in which case the tokens after the one that completed it are dropped."""
        state = self._child_state[req.request_id]
        params = self._child_parent[req.request_id].params
        first = req.num_output_tokens - req.num_new_tokens
        for j in range(first, req.num_output_tokens):
            if update_text(state, self._backend_tokenizer, params, req.output_token_ids[j]):
                self.scheduler.truncate_output(req, j + 1)
                return True
        return False

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars compiling: wait for one (up to 10 ms) instead of
        spinning empty steps against the compile thread."""
        futures = [
            r.structured_output.grammar
            for r in self.scheduler.waiting_for_grammar
            if r.structured_output is not None
        ]
        concurrent.futures.wait(futures, timeout=0.01, return_when="FIRST_COMPLETED")

    def _decoder(self, params: SamplingParams) -> TokenDecoder:
        """How a request's logprobs get their ``decoded_token``: None when it has no text."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return self._token_text

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone (vLLM's ``decoded_token``, the server's logprob token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _fail_requests(self, reasons: dict[str, str]) -> list[str]:
        """Finish the parents of the failed child requests (all their children: they share
        the data that failed) with finish reason ``error``; returns the parent ids."""
        parents: list[str] = []
        for cid, reason in reasons.items():
            parent = self._child_parent.get(cid)
            if parent is None or parent.error is not None:
                continue
            logger.warning("request %s failed and is finished: %s", parent.request_id, reason)
            parent.error = reason
            ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            now = time.monotonic()
            for c in parent.children:
                if c.finish_reason is None:
                    c.finish_reason = RequestStatus.FINISHED_ERROR.finish_reason
                    c.request.metrics.finished_time = now
            parents.append(parent.request_id)
        return parents

    def _collect(self, parent_ids: dict[str, None]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for pid in parent_ids:
            parent = self._parents[pid]
            pooling = parent.pooling is not None
            outputs.append(parent.embedding_output() if pooling else parent.output())
            if parent.finished:
                del self._parents[pid]
                for c in parent.children:
                    self._child_parent.pop(c.request.request_id, None)
                    self._child_state.pop(c.request.request_id, None)
        return outputs

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
