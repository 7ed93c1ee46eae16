"""Turns a step message (``SchedulerOutput``) into one forward pass and the new tokens of
each finishing row.

``ModelRunner(config, tp)`` builds everything it runs from the engine's config (nano-vllm's
``ModelRunner(config, rank, event)``): the model (its rank's share under tensor parallelism,
``tp`` its place among the ranks), the draft proposer, the KV cache and swap space, and
warms up; the engine gets the sizes back (``info``). It lives in the engine's process
(``UniProcExecutor``) or in a worker process per rank (``MultiprocExecutor``): its input is
plain data, and it keeps its own state of every request (``input_batch.py``). Each step it
applies the message, does the swap copies, flattens the scheduled tokens of all requests
into one batch (no padding between requests), builds slot mappings and block tables, runs
the model, and samples the rows that reached the end of their tokens. With speculative
decoding a row also computes the request's proposed tokens: its last k + 1 positions give
logits, the rejection sampler keeps the accepted run (``sample/rejection.py``), and the
proposer (``kvserve/spec``) proposes the next step's tokens. Embedding requests share the
batch but never sample: their final hidden states are pooled (``pooling.py``) when their
prompt is complete. A batch whose forward raises is run again request by request, so a fault
stays with its request (``engine/fault_isolation.py``).

Under tensor parallelism every rank runs every step: the same forward and the same
``compute_logits`` calls (collectives: same rows, same order), so the per-request state
stays identical on every rank. Only rank 0 gets logits; the other ranks skip sampling,
prompt logprob post-processing and proposing, and return an empty output (the driver uses
rank 0's). A failed step is not retried per request there: a retry on one rank would pair
its collectives with the other ranks' different ones; the step's error is raised and the
executor stops the engine (``RankFailedError``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from kvserve.attention.selector import select_for_model
from kvserve.config import AttentionBackendEnum, EngineConfig, ModelConfig
from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest
from kvserve.model.base import CausalLM, ForwardBatch
from kvserve.model.loader import load_hf_config
from kvserve.ops.malloc_tuning import (
    keep_freed_memory,
    load_in_own_mappings,
    own_mappings,
    trim_heap,
)
from kvserve.ops.packed_linear import packing_supported
from kvserve.sample.host_io import tensor_to_device, to_device
from kvserve.spec.build import build_proposer
from kvserve.spec.proposer import ProposalInput
from kvserve.worker.cuda_graph import DecodeGraphs, decode_rows, graphs_off_reason
from kvserve.worker.execution_paths import collect_paths
from kvserve.worker.input_batch import CachedRequestState, InputBatch, StepRows
from kvserve.worker.inputs import allocate_kv_caches, build_metadata, kv_bytes_per_block
from kvserve.worker.memory_profile import cuda_kv_bytes, dummy_prefill
from kvserve.worker.model_setup import (
    kv_cache_size,
    load_draft,
    load_target,
    resolve_max_model_len,
)
from kvserve.worker.pooling import Pooler
from kvserve.worker.prompt_logprobs import (
    commit_prompt_logprobs,
    compute_prompt_logprobs,
    prompt_logprob_rows,
)
from kvserve.worker.row_sampling import RowSampler
from kvserve.worker.runner_output import ModelRunnerOutput, RunnerInfo, StepTimings
from kvserve.worker.step_interrupt import StepInterrupt, StepInterrupted

__all__ = [
    "ModelRunner",
    "ModelRunnerOutput",
    "StepTimings",
    "allocate_kv_caches",
    "build_metadata",
    "kv_bytes_per_block",
]

logger = logging.getLogger("kvserve.runner")


def quantization_name(mc: ModelConfig) -> str | None:
    """The quantization method's name (int8, int4, gguf, ...), None when weights are dense."""
    q = mc.quantization
    return None if q is None else str(getattr(q, "value", q))


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE) -> None:
        """Build the runner of rank ``tp.rank`` (its process group already joined): load the
        model (its shard) and draft, allocate the KV cache and swap space, warm up."""
        t0 = time.perf_counter()
        mc, cc = config.model, config.cache
        if tp.world_size != config.parallel.world_size:
            raise ValueError(f"a runner of {tp.world_size} rank(s) for tensor_parallel_size "
                             f"{config.parallel.world_size}")  # fmt: skip
        self.config = config
        self.tp = tp
        self.device = device = torch.device(config.device)
        self.block_size = cc.block_size
        hf_config = load_hf_config(mc.path)
        self.max_model_len = resolve_max_model_len(mc, hf_config)
        if mc.enable_sleep_mode and device.type == "cpu":
            load_in_own_mappings()  # so that sleep level 2 gives all of them back
        self.model: CausalLM = load_target(config, self.max_model_len, tp)
        draft = load_draft(config, hf_config, self.max_model_len)
        # LoRA adapters: device slots in every adapted layer, host LRU (kvserve/lora)
        self.lora: LoRAManager | None = None
        if config.lora is not None:
            self.lora = LoRAManager(self.model, config.lora, mc.dtype, device, tp)
        # what every attention layer calls; owns the step's gather buffers
        self.attn_backend = select_for_model(
            mc.attention_backend, self.model.config, self.model.head_dim, device, mc.dtype
        )
        if mc.batch_invariant and self.attn_backend.name is not AttentionBackendEnum.CPU_KERNEL:
            raise ValueError(
                "batch-invariant mode (--batch-invariant) needs the CPU_KERNEL attention "
                f"backend; {self.attn_backend.name.value} was selected (the C++ kernels did "
                "not build, or the model's head size does not fit the kernel)"
            )
        kv_bytes = None  # CUDA: vLLM's gpu_memory_utilization, after a profiled dummy step
        if device.type == "cuda" and cc.gpu_memory_utilization is not None:
            kv_bytes = cuda_kv_bytes(self.model, self.attn_backend, cc.gpu_memory_utilization,
                                     config.scheduler, cc.block_size, mc.dtype,
                                     self.max_model_len)  # fmt: skip
        size = kv_cache_size(config, self.model, draft, kv_bytes)
        self.num_blocks = size.num_blocks
        # CUDA graphs of decode steps (worker/cuda_graph.py): their padding rows write into
        # one scratch block past the engine's blocks, allocated only when graphs may run
        graphs_off = graphs_off_reason(device, mc.enforce_eager, self.attn_backend, self.model,
                                       tp.world_size)  # fmt: skip
        self.scratch_block: int | None = None if graphs_off else size.num_blocks
        self.kv_caches = allocate_kv_caches(self.model, self._kv_blocks(), cc.block_size,
                                            mc.dtype, device)  # fmt: skip
        # CPU swap space, same layout; swap copies stage through pinned memory on CUDA.
        self.swap_caches = allocate_kv_caches(
            self.model, size.num_swap_blocks, cc.block_size, mc.dtype, torch.device("cpu")
        ) if size.num_swap_blocks > 0 else []  # fmt: skip
        self.timings = StepTimings()
        self.pooler = Pooler()  # embedding requests: mean-pooling sums across prefill chunks
        self.input_batch = InputBatch(device)  # the runner's state of each request
        # the engine's flag for giving background-only steps up (set by the engine when the
        # runner is in its process: worker/step_interrupt.py); None: never given up
        self.step_interrupt: StepInterrupt | None = None
        # custom batch-level logits processors (vLLM v1's interface), one instance each
        processors = [cls(config, device, False) for cls in mc.logits_processors]
        self.sampler = RowSampler(processors, torch.Generator(device=device).manual_seed(mc.seed))
        # speculative decoding: proposes each row's next tokens
        self.proposer = build_proposer(config, draft, size.num_blocks, self)
        # After the weights and KV cache exist, so only step-time buffers are affected.
        self.malloc_tuned = device.type == "cpu" and keep_freed_memory()
        warmup_tokens = 0
        # bf16 only: there the first max-size prefill paid oneDNN's kernel set-up (0.80 s, later
        # ones 0.60 s, 160M model). Float32 packing on AVX2 showed no first-prefill penalty (the
        # first of three 2048-token prefills of the 135M model was not the slowest), while the
        # dummy prefill itself is one whole max-size prefill on every start (docs/performance.md).
        if (mc.warmup and mc.prepack_weights and mc.dtype == torch.bfloat16
                and packing_supported(device, mc.dtype)):  # fmt: skip
            # After the malloc tuning, so the warm-up's buffers stay in the heap for reuse.
            t1 = time.perf_counter()
            max_tokens = config.scheduler.max_num_batched_tokens
            warmup_tokens = self.warm_up(max_tokens, self.max_model_len)
            logger.info("warm-up: %d-token dummy prefill in %.2fs", warmup_tokens,
                        time.perf_counter() - t1)  # fmt: skip
        self.decode_graphs: DecodeGraphs | None = None
        self._graphs_asleep: tuple[tuple[int, ...], bool] | None = None  # (sizes, captured)
        if graphs_off is None:
            self.enable_decode_graphs(config.compilation.cudagraph_capture_sizes, capture=True)
        elif device.type == "cuda":
            logger.info("CUDA graphs off: %s", graphs_off)
        self.info = RunnerInfo(
            num_blocks=size.num_blocks,
            num_swap_blocks=size.num_swap_blocks,
            bytes_per_block=size.bytes_per_block,
            attention_backend=self.attn_backend.name.value,
            paths=collect_paths(
                self.model, device, mc.dtype, quantization_name(mc), self._captured_sizes()
            ),
            warmup_tokens=warmup_tokens,
            load_seconds=time.perf_counter() - t0,
        )

    def _captured_sizes(self) -> tuple[int, ...]:
        graphs = self.decode_graphs
        return graphs.sizes if graphs is not None and graphs.captured else ()

    def _kv_blocks(self) -> int:
        """Blocks of the KV tensors: the engine's, plus the scratch block when it exists."""
        return self.num_blocks + (self.scratch_block is not None)

    def enable_decode_graphs(self, sizes: tuple[int, ...], *, capture: bool) -> None:
        """Run decode-only steps of up to ``max(sizes)`` rows through static inputs padded to
        ``sizes`` (``worker/cuda_graph.py``), captured as CUDA graphs with ``capture``; a
        capture that fails is logged and leaves every step eager. ``capture=False`` runs the
        same path eagerly (the CPU tests); before the first request only, as it may
        reallocate the KV cache with the scratch block."""
        if self.scratch_block is None:
            if len(self.input_batch):
                raise RuntimeError("static decode inputs need a scratch block: enable them "
                                   "before the first request")  # fmt: skip
            self.scratch_block = self.num_blocks
            mc = self.config.model
            self.kv_caches = allocate_kv_caches(self.model, self._kv_blocks(), self.block_size,
                                                mc.dtype, self.device)  # fmt: skip
        max_len = min(self.max_model_len, self.config.compilation.max_seq_len_to_capture)
        graphs = DecodeGraphs(
            self.model, self.attn_backend, self.kv_caches, sizes, block_size=self.block_size,
            max_len=max_len, scratch_block=self.scratch_block, device=self.device,
        )  # fmt: skip
        if capture:
            try:
                graphs.capture()
            except Exception as exc:
                logger.warning("CUDA graph capture failed, decode steps run eager: %r", exc)
                return
        self.decode_graphs = graphs

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_len: int) -> int:
        """A dummy prefill of up to ``num_tokens`` tokens before serving (vLLM's dummy run).

        The first step of a new size pays one-time costs: oneDNN builds kernels for the row
        count and the heap grows to the step's buffers (a 3840-token prefill of the 160M model
        took 0.8 s cold, 0.6 s after). The dummy rows fill blocks from 0 up; no request owns
        them yet and every slot is written before it is read, so nothing leaks into a request.
        Nothing is sampled. Every rank runs it (its collectives too). Returns the number of
        tokens run.
        """
        return dummy_prefill(self.model, self.attn_backend, self.kv_caches, self.num_blocks,
                             self.block_size, num_tokens, max_len)  # fmt: skip

    # -- LoRA adapters (the engine calls these through the executor) ---------------------------
    def add_lora(self, req: LoRARequest) -> bool:
        """Read and check an adapter into host memory (vLLM's ``add_lora``); False if it was
        there already. Raises a ValueError with the reason for a bad adapter."""
        return self._lora_manager().add(req)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests in flight on it finish first."""
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list_ids()

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora=True")
        return self.lora

    def trim_heap(self) -> None:
        """Hand this process's freed C heap back to the OS: the engine calls it on every rank
        once it has been idle for ``IDLE_TRIM_SECONDS`` (``ops/malloc_tuning.py``)."""
        trim_heap()

    # -- sleep mode (kvserve/engine/sleep_mode.py; the engine calls these on every rank) ------
    def sleep(self, level: int) -> None:
        """Free the KV cache and swap space (level 1) and the weights too (level 2), then
        hand the freed heap to the OS. The engine has no unfinished request: nothing is lost.
        """
        self.kv_caches = []
        self.swap_caches = []
        if self.decode_graphs is not None:  # they point at the KV tensors: built again on wake
            self._graphs_asleep = (self.decode_graphs.sizes, self.decode_graphs.captured)
            self.decode_graphs.release()
            self.decode_graphs = None
        if level >= 2:
            self.model = None  # type: ignore[assignment]  # read again by wake_up
        gc.collect()  # the tensors' last references may sit in reference cycles
        trim_heap()

    def wake_up(self) -> None:
        """Undo ``sleep``: read the weights again if they were dropped (the same files, so
        the same numbers), then allocate a zeroed KV cache of the same size."""
        # in their own mappings, so the next sleep gives all of them back (malloc_tuning.py)
        with own_mappings(self.malloc_tuned):
            if self.model is None:
                self.model = load_target(self.config, self.max_model_len, self.tp)
            if not self.kv_caches:
                dtype, bs, dev = self.config.model.dtype, self.block_size, self.device
                self.kv_caches = allocate_kv_caches(self.model, self._kv_blocks(), bs, dtype, dev)
                if self.info.num_swap_blocks:
                    self.swap_caches = allocate_kv_caches(
                        self.model, self.info.num_swap_blocks, bs, dtype, torch.device("cpu")
                    )
        if self._graphs_asleep is not None:  # the graphs sleep dropped, over the new tensors
            sizes, captured = self._graphs_asleep
            self._graphs_asleep = None
            self.enable_decode_graphs(sizes, capture=captured)

    def swap(self, sched: SchedulerOutput) -> None:
        """The step's block copies: swap-out first, then swap-in, then copy-on-write."""
        # Swap-out runs first: its device blocks may be handed to other requests this step.
        if sched.blocks_to_swap_out:
            self._swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in sched.blocks_to_swap_in])
            dst = to_device([d for _, d in sched.blocks_to_swap_in], torch.long, self.device)
            for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
                # pinned on CUDA: the copy is queued, and the scatter after it on the stream
                k[dst] = tensor_to_device(sk[src], self.device)
                v[dst] = tensor_to_device(sv[src], self.device)
        # Copy-on-write of blocks shared by forked beams, after swap-in: a beam swapped in
        # this step never shares, so the order only matters for blocks freed by swap-out.
        if sched.blocks_to_copy:
            src = torch.tensor([s for s, _ in sched.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in sched.blocks_to_copy], device=self.device)
            for k, v in self.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to swap blocks ((device, swap) pairs). On CUDA every layer's
        blocks go in one gather, one non-blocking copy into pinned memory and one wait
        (a blocking ``.cpu()`` per layer and tensor was 2 x layers waits)."""
        dst = torch.tensor([c for _, c in pairs])
        src = to_device([d for d, _ in pairs], torch.long, self.device)
        if self.device.type != "cuda":
            for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
                sk[dst] = k[src]
                sv[dst] = v[src]
            return
        # [2 * layers, n, Hkv, block_size, D]: every layer's K then V of those blocks
        stacked = torch.stack([t[src] for kv in self.kv_caches for t in kv])
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the host reads it next
        for i, (sk, sv) in enumerate(self.swap_caches):
            sk[dst] = host[2 * i]
            sv[dst] = host[2 * i + 1]

    def _prepare(self, rows: StepRows) -> tuple[ForwardBatch, list[int]]:
        """The step's forward batch, and the flat rows whose logits are sampled (a
        verification row's last k + 1, one for any other finishing row)."""
        ids: list[int] = []
        meta_rows: list[tuple[list[int], int, int]] = []
        logits_idx: list[int] = []
        spec_rows: list[int] = []
        offset = 0
        for i, req in enumerate(rows.scheduled):
            rid = req.request_id
            n = rows.num_scheduled_tokens[rid]
            start = req.num_computed_tokens
            spec = rows.scheduled_spec_decode_tokens.get(rid, [])
            ids.extend(req.all_token_ids[start : start + n])
            ids.extend(spec)  # the proposals follow the request's own tokens
            meta_rows.append((req.block_ids, start, n))
            offset += n
            if rows.samples(req):
                logits_idx.extend(range(offset - 1 - len(spec), offset))
            if spec:
                spec_rows.append(i)
        if self.config.model.batch_invariant:
            # every query attends as a one-token row through the decode kernel, which sums
            # over its keys in one order whether the token came in a prompt chunk or decoding
            spec_rows = list(range(len(rows.scheduled)))
        md, positions = build_metadata(meta_rows, self.block_size, self.device,
                                       frozenset(spec_rows))  # fmt: skip
        md = self.attn_backend.build_metadata(md)
        input_ids = to_device(ids, torch.long, self.device)  # [T], no sync on CUDA
        lora = None
        if self.lora is not None:
            counts = [n for _, _, n in meta_rows]  # each row's tokens, proposals included
            lora = self.lora.prepare([r.lora_request for r in rows.scheduled], counts)
        batch = ForwardBatch(input_ids, positions, self.kv_caches, md, self.attn_backend, lora=lora)
        return batch, logits_idx

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, swap: bool = True) -> ModelRunnerOutput:
        """Run one step message: apply it to the runner's requests, do the swap copies
        (``swap=False``: the caller did them), then the batch. If the batch raises, each
        request runs again alone (nothing advanced: its K/V slots are simply written again)
        and those that fail alone are reported in ``failed``; a failed swap copy raises (K/V
        is lost: the engine's fault)."""
        t0 = time.perf_counter()
        rows = self.input_batch.update(sched)
        if self.lora is not None:
            self.lora.set_live(
                r.lora_request.lora_int_id
                for r in self.input_batch.requests.values()
                if r.lora_request is not None
            )
        if self.proposer is not None:
            self.proposer.forget(sched.finished_req_ids, sched.preempted_req_ids)
        if len(self.pooler):
            self.pooler.forget(sched.finished_req_ids)
        if swap:
            self.swap(sched)
        if not rows.scheduled:
            return ModelRunnerOutput({})
        seeded = [r for r in rows.scheduled if r.generator is not None]
        states = [r.generator.get_state() for r in seeded if r.generator is not None]
        phases = {"prepare": time.perf_counter() - t0}
        try:
            out = self._run_watched(rows, sched, phases)
        except StepInterrupted:  # before sampling: nothing advanced, the engine applies nothing
            return ModelRunnerOutput({}, timings=phases, interrupted=True)
        except Exception:
            if self.tp.world_size > 1:
                raise  # no per-request retry across ranks (see the module doc)
            logger.exception(
                "a step of %d requests failed; retrying each request alone", len(rows.scheduled)
            )
            for r, state in zip(seeded, states, strict=True):
                if r.generator is not None:
                    r.generator.set_state(state)  # the retry draws what the batch would have
            out = ModelRunnerOutput({})
            for req in rows.scheduled:
                try:
                    out.update(self._run(rows.only(req), sched, phases))
                except Exception as exc:
                    out.failed[req.request_id] = f"the forward pass failed: {exc!r}"
        out.timings = phases
        self.timings.add(phases)
        self.timings.steps += 1
        return out

    def _run_watched(
        self, rows: StepRows, sched: SchedulerOutput, phases: dict[str, float]
    ) -> ModelRunnerOutput:
        """The step's batch; an interruptible one is watched by the engine's flag while it
        runs and may raise ``StepInterrupted`` (``worker/step_interrupt.py``). Worker
        processes get no flag: their steps run to the end."""
        interrupt = self.step_interrupt if sched.interruptible else None
        if interrupt is None:
            return self._run(rows, sched, phases)
        interrupt.begin(sched.online_ids)
        try:
            return self._run(rows, sched, phases, interrupt)
        finally:
            interrupt.end()

    def _run(
        self,
        rows: StepRows,
        sched: SchedulerOutput,
        phases: dict[str, float],
        interrupt: StepInterrupt | None = None,
    ) -> ModelRunnerOutput:
        """Forward, logits, prompt logprobs, pooling, sampling and proposals of ``rows``
        (the step's, or one request of them); the runner's per-request results are committed
        only when all of it succeeded. Reads only plain fields of ``sched``. ``interrupt``:
        the forward may raise ``StepInterrupted`` between layers (nothing done yet)."""
        t0 = time.perf_counter()
        graph_hidden = self._graph_forward(rows)
        if graph_hidden is not None:  # decode only: one row per request, each sampled
            t1 = t0  # the inputs' fill is inside the replay's time
            hidden = sampled = graph_hidden  # [B, hidden]
        else:
            batch, logits_idx = self._prepare(rows)
            if interrupt is not None:
                batch = dataclasses.replace(batch, interrupt=interrupt)
            t1 = time.perf_counter()
            hidden = self.model(batch)  # [T, hidden]
            # the rows as a device tensor: indexing with a list copies it with a sync on CUDA
            sampled = hidden[to_device(logits_idx, torch.long, hidden.device)]
        reqs = [r for r in rows.scheduled if rows.samples(r)]
        logits = self.model.compute_logits(sampled) if reqs else None  # [N, V]
        t2 = time.perf_counter()
        # Before sampling: if this raises, the step is retried per request and no seeded
        # generator has advanced yet.
        lp_rows = prompt_logprob_rows(rows)
        prompt_lps = compute_prompt_logprobs(self.model, lp_rows, hidden) if lp_rows else {}
        pooled, sums = {}, {}
        if any(r.pooling is not None for r in rows.scheduled):
            pooled, sums = self.pooler.step(rows, hidden, self.model.compute_logits)
        out = ModelRunnerOutput({})
        # None on ranks > 0 (tensor parallelism): only rank 0 samples and proposes.
        if logits is not None:
            grammar = (sched.grammar_bitmask, sched.structured_output_rows)
            out = self.sampler.sample_all(reqs, logits, rows, grammar)
        out.prompt_logprobs.update(prompt_lps)
        out.pooled = pooled if self.tp.is_driver else {}  # ranks > 0: an empty output
        t3 = time.perf_counter()
        if self.proposer is not None and sched.propose and out.sampled:
            out.spec_token_ids = self._propose(reqs, out)
        # last: nothing after this can fail the step and retry it
        self.pooler.commit(sums)
        commit_prompt_logprobs(lp_rows)
        t4 = time.perf_counter()
        for k, v in (("prepare", t1 - t0), ("forward", t2 - t1), ("sample", t3 - t2),
                     ("propose", t4 - t3)):  # fmt: skip
            phases[k] = phases.get(k, 0.0) + v
        return out

    def _graph_forward(self, rows: StepRows) -> torch.Tensor | None:
        """The hidden states ``[B, hidden]`` of a step the decode graphs run, else None
        (eager). A graph step that raises turns the graphs off (one warning) and the step
        runs eager."""
        graphs = self.decode_graphs
        decode = None if graphs is None else decode_rows(rows)
        if graphs is None or decode is None:
            return None
        try:
            size = graphs.prepare(decode)
            return None if size is None else graphs.run(size, len(decode))
        except Exception as exc:
            logger.warning("a CUDA graph decode step failed, every step runs eager: %r", exc)
            self.decode_graphs = None
            return None

    def _propose(
        self, reqs: list[CachedRequestState], out: ModelRunnerOutput
    ) -> dict[str, list[int]]:
        """The next step's proposals for the requests that got tokens and may speculate."""
        assert self.proposer is not None
        batch = []
        for r in reqs:
            new = out.sampled.get(r.request_id)
            # Grammar-constrained requests do not speculate (their matcher would have to
            # check each proposal); the scheduler caps the rest by max_tokens.
            if not new or r.structured:
                continue
            room = r.max_tokens - r.num_output_tokens - len(new) - 1
            if room > 0:
                tokens = [*r.all_token_ids, *new]
                batch.append(ProposalInput(r.request_id, tokens, r.block_ids, room))
        return self.proposer.propose(batch) if batch else {}
