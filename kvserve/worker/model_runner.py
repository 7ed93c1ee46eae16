"""Turns a ``SchedulerOutput`` into one forward pass and the new tokens of each finishing row.

The runner owns the physical KV tensors (device and CPU swap) and the model. It flattens
the scheduled tokens of all requests into one batch (no padding between requests), builds
slot mappings and block tables, runs the model, and samples on the rows that reached the end
of their tokens. With speculative decoding a row also computes the request's proposed tokens:
its last k + 1 positions give logits, the rejection sampler keeps the accepted run
(``sample/rejection.py``), and the proposer (``kvserve/spec``) proposes the next step's tokens.
Embedding requests share the batch but never sample: their final hidden states are pooled
(``pooling.py``) when their prompt is complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvserve.config import AttentionBackend
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model import cpu_kernels
from kvserve.model.attention import AttentionMetadata, GatherWorkspace
from kvserve.model.base import CausalLM
from kvserve.sample.custom_processors import BatchProcessors, LogitsProcessor
from kvserve.sample.rejection import expand_for_verification, rejection_sample
from kvserve.sample.sampler import NoTokenAllowedError, SamplingMetadata, sample
from kvserve.spec.proposer import ProposalInput, Proposer
from kvserve.worker.inputs import allocate_kv_caches, build_metadata, kv_bytes_per_block
from kvserve.worker.pooling import Pooler, SumUpdates
from kvserve.worker.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_rows
from kvserve.worker.runner_output import (
    ModelRunnerOutput,
    StepTimings,
    sampler_output_to_runner,
    spec_output_to_runner,
)

__all__ = [
    "ModelRunner",
    "ModelRunnerOutput",
    "StepTimings",
    "allocate_kv_caches",
    "build_metadata",
    "kv_bytes_per_block",
]

logger = logging.getLogger("kvserve.runner")


def _use_decode_kernel(
    backend: AttentionBackend, device: torch.device, dtype: torch.dtype, model: CausalLM
) -> bool:
    """Resolve the decode attention backend: may the C++ CPU kernel run this model?"""
    if backend is AttentionBackend.SDPA:
        return False
    # 16 floats = one AVX-512 vector, the widest the kernel is compiled for.
    fits = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    fits = fits and model.head_dim % 16 == 0
    if backend is AttentionBackend.CPU_KERNEL:
        if not fits:
            raise ValueError(
                "attention_backend 'cpu_kernel' needs a CPU device, float32 or bfloat16 and a "
                f"head_dim that is a multiple of 16 (got {device}, {dtype}, {model.head_dim})."
            )
        if not cpu_kernels.available():
            raise RuntimeError("attention_backend 'cpu_kernel': the CPU kernels failed to build.")
        return True
    return fits and cpu_kernels.available()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        num_swap_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        attention_backend: AttentionBackend = AttentionBackend.AUTO,
        logits_processors: Sequence[LogitsProcessor] = (),
        proposer: Proposer | None = None,
    ) -> None:
        self.model = model
        self.proposer = proposer  # speculative decoding: proposes each row's next tokens
        # custom batch-level logits processors (vLLM v1's interface), built by the engine
        self.batch_processors = BatchProcessors(logits_processors)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        shape = (num_blocks, model.num_kv_heads, block_size, model.head_dim)
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, device)
        swap_shape = (num_swap_blocks, *shape[1:])
        # CPU swap space, same layout; pinned memory would speed GPU copies, plain is fine here.
        self.swap_caches = (
            [
                (torch.empty(swap_shape, dtype=dtype), torch.empty(swap_shape, dtype=dtype))
                for _ in range(model.num_layers)
            ]
            if num_swap_blocks > 0
            else []
        )
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.timings = StepTimings()
        self.workspace = GatherWorkspace()  # decode K/V gather buffers, reused every step
        self.use_decode_kernel = _use_decode_kernel(attention_backend, device, dtype, model)
        self.pooler = Pooler()  # embedding requests: mean-pooling sums across prefill chunks

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_len: int) -> int:
        """A dummy prefill of up to ``num_tokens`` tokens before serving (vLLM's dummy run).

        The first step of a new size pays one-time costs: oneDNN builds kernels for the row
        count and the heap grows to the step's buffers (a 3840-token prefill of the 160M model
        took 0.8 s cold, 0.6 s after). The dummy rows fill blocks from 0 up; no request owns
        them yet and every slot is written before it is read, so nothing leaks into a request.
        Nothing is sampled. Returns the number of tokens run.
        """
        bs = self.block_size
        row_len = min(bs * max(1, 32 // bs), max_len)  # ~32-token prompts, whole blocks
        per_row = -(-row_len // bs)  # blocks per row
        rows = min(num_tokens // row_len, self.num_blocks // per_row)
        if rows == 0:
            return 0
        dev = self.device
        pos = torch.arange(row_len, device=dev)
        first = torch.arange(rows, device=dev) * per_row  # each row's first block
        md = AttentionMetadata(
            slot_mapping=(first[:, None] * bs + pos).reshape(-1),  # [rows * row_len]
            query_start_loc=[i * row_len for i in range(rows + 1)],
            seq_lens=[row_len] * rows,
            block_tables=first[:, None] + torch.arange(per_row, device=dev),  # [rows, per_row]
            block_size=bs,
        )
        ids = torch.zeros(rows * row_len, dtype=torch.long, device=dev)
        positions = pos.repeat(rows)
        md.split_rows(self.workspace, self.use_decode_kernel)
        hidden = self.model(ids, positions, self.kv_caches, md)  # [rows * row_len, hidden]
        self.model.compute_logits(hidden[row_len - 1 :: row_len])  # [rows, V]
        return rows * row_len

    def swap(self, sched: SchedulerOutput) -> None:
        """The step's swap copies (swap-out first, then swap-in)."""
        # Swap-out runs first: its device blocks may be handed to other requests this step.
        if sched.blocks_to_swap_out:
            src = torch.tensor([d for d, _ in sched.blocks_to_swap_out], device=self.device)
            dst = torch.tensor([c for _, c in sched.blocks_to_swap_out])
            for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
                sk[dst] = k[src].cpu()
                sv[dst] = v[src].cpu()
        if sched.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in sched.blocks_to_swap_in])
            dst = torch.tensor([d for _, d in sched.blocks_to_swap_in], device=self.device)
            for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
                k[dst] = sk[src].to(self.device)
                v[dst] = sv[src].to(self.device)

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, the attention metadata, and the flat rows whose
        logits are sampled (a verification row's last k + 1, one for any other finishing row)."""
        ids: list[int] = []
        rows: list[tuple[list[int], int, int]] = []
        logits_idx: list[int] = []
        spec_rows: list[int] = []
        offset = 0
        for i, req in enumerate(sched.scheduled):
            rid = req.request_id
            n = sched.num_scheduled_tokens[rid]
            start = req.num_computed_tokens
            spec = sched.scheduled_spec_decode_tokens.get(rid, [])
            ids.extend(req.all_token_ids[start : start + n])
            ids.extend(spec)  # the proposals follow the request's own tokens
            rows.append((sched.block_tables[rid], start, n))
            offset += n
            if sched.samples(req):
                logits_idx.extend(range(offset - 1 - len(spec), offset))
            if spec:
                spec_rows.append(i)
        md, positions = build_metadata(rows, self.block_size, self.device, frozenset(spec_rows))
        md.split_rows(self.workspace, self.use_decode_kernel)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        return input_ids, positions, md, logits_idx

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, swap: bool = True) -> ModelRunnerOutput:
        """Run one step. ``swap=False`` skips the swap copies: a retry of a failed step must
        not redo them (a swapped-out block may already hold another request's new K/V)."""
        t0 = time.perf_counter()
        if swap:
            self.swap(sched)
        if self.proposer is not None:
            self.proposer.forget(sched.finished_req_ids, sched.preempted_req_ids)
        if len(self.pooler):
            self.pooler.forget(sched.finished_req_ids)
        if not sched.scheduled:
            return ModelRunnerOutput({})
        input_ids, positions, md, logits_idx = self._prepare(sched)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, md)  # [T, hidden]
        reqs = [r for r in sched.scheduled if sched.samples(r)]
        logits = self.model.compute_logits(hidden[logits_idx]) if reqs else None  # [N, V]
        t2 = time.perf_counter()
        # Before sampling: if this raises, the step is retried per request and no seeded
        # generator has advanced yet.
        rows = prompt_logprob_rows(sched)
        prompt_lps = compute_prompt_logprobs(self.model, rows, hidden) if rows else {}
        pooled: dict[str, list[float]] = {}
        sums: SumUpdates = {}
        if any(r.pooling is not None for r in sched.scheduled):
            pooled, sums = self.pooler.step(sched, hidden)
        out = ModelRunnerOutput({})
        if logits is not None:
            out = self._sample_all(reqs, logits, sched)
        out.prompt_logprobs.update(prompt_lps)
        out.pooled = pooled
        t3 = time.perf_counter()
        if self.proposer is not None and sched.propose and out.sampled:
            out.spec_token_ids = self._propose(reqs, out, sched)
        self.pooler.commit(sums)  # last: nothing after it can fail the step and retry it
        t4 = time.perf_counter()
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += t3 - t2
        self.timings.propose += t4 - t3
        self.timings.steps += 1
        return out

    def _sample_all(
        self, reqs: list[Request], logits: torch.Tensor, sched: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Rows without proposals go through the sampler, verification rows (k + 1 logits
        rows each, in batch order) through the rejection sampler."""
        if not sched.scheduled_spec_decode_tokens:
            return self._sample(reqs, logits, sched)
        plain_reqs: list[Request] = []
        plain_rows: list[int] = []
        spec_reqs: list[Request] = []
        spec_rows: list[int] = []
        row = 0
        for r in reqs:
            k = sched.num_spec_tokens(r)
            (spec_reqs if k else plain_reqs).append(r)
            (spec_rows if k else plain_rows).extend(range(row, row + k + 1))
            row += k + 1
        out = ModelRunnerOutput({})
        if plain_reqs:
            out.update(self._sample(plain_reqs, logits[plain_rows], sched))
        if spec_reqs:
            out.update(self._verify(spec_reqs, logits[spec_rows], sched))
        return out

    def _verify(
        self, reqs: list[Request], logits: torch.Tensor, sched: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Accept or reject each request's proposals; a failure is narrowed to one request."""
        drafts = [sched.scheduled_spec_decode_tokens[r.request_id] for r in reqs]
        md = expand_for_verification(self._sampling_metadata(reqs, sched), drafts)
        states = [None if r.generator is None else r.generator.get_state() for r in reqs]
        try:
            return spec_output_to_runner(reqs, rejection_sample(logits, md, drafts))
        except Exception:
            logger.exception("verifying %d requests failed; retrying one by one", len(reqs))
        out = ModelRunnerOutput({})
        row = 0
        for r, draft, state in zip(reqs, drafts, states, strict=True):
            one = expand_for_verification(self._sampling_metadata([r], sched), [draft])
            if r.generator is not None and state is not None:
                r.generator.set_state(state)
            try:
                res = rejection_sample(logits[row : row + len(draft) + 1], one, [draft])
                out.update(spec_output_to_runner([r], res))
            except Exception as exc:
                why = str(exc) if isinstance(exc, NoTokenAllowedError) else repr(exc)
                out.failed[r.request_id] = f"sampling failed: {why}"
            row += len(draft) + 1
        return out

    def _propose(
        self, reqs: list[Request], out: ModelRunnerOutput, sched: SchedulerOutput
    ) -> dict[str, list[int]]:
        """The next step's proposals for the requests that got tokens and may speculate."""
        assert self.proposer is not None
        batch = []
        for r in reqs:
            new = out.sampled.get(r.request_id)
            # Grammar-constrained requests do not speculate (their matcher would have to
            # check each proposal); the scheduler caps the rest by max_tokens.
            if not new or r.structured_output is not None:
                continue
            room = r.max_tokens - r.num_output_tokens - len(new) - 1
            if room > 0:
                tokens = [*r.all_token_ids, *new]
                batch.append(ProposalInput(r.request_id, tokens, sched.block_tables[r.request_id],
                                           room))  # fmt: skip
        return self.proposer.propose(batch) if batch else {}

    def _sample(
        self, reqs: list[Request], logits: torch.Tensor, sched: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Sample one token per row; a failure is narrowed to the rows that cause it."""
        md = self._sampling_metadata(reqs, sched)
        md.batch_processors = self._tell_processors(reqs)
        # Seeded rows: keep their generator states, so that a retry draws the same noise.
        states = [None if g is None else g.get_state() for g in md.generators]
        try:
            return sampler_output_to_runner(reqs, sample(logits, md))
        except Exception:
            logger.exception("sampling a batch of %d rows failed; retrying row by row", len(reqs))
        out = ModelRunnerOutput({})
        for i, r in enumerate(reqs):
            gen, state = md.generators[i], states[i]
            if gen is not None and state is not None:
                gen.set_state(state)
            try:
                row = md.row(i)
                row.batch_processors = self._tell_processors([r])
                res = sample(logits[i : i + 1], row)  # [1, V]
            except Exception as exc:
                why = str(exc) if isinstance(exc, NoTokenAllowedError) else repr(exc)
                out.failed[r.request_id] = f"sampling failed: {why}"
                continue
            out.update(sampler_output_to_runner([r], res))
        return out

    def _tell_processors(self, reqs: list[Request]) -> list[LogitsProcessor]:
        """Report the rows to the custom batch processors; returns them (none: [])."""
        added = [(r.params, r.prompt_token_ids, r.output_token_ids) for r in reqs]
        return self.batch_processors.update([r.request_id for r in reqs], added)

    def _sampling_metadata(self, reqs: list[Request], sched: SchedulerOutput) -> SamplingMetadata:
        # Structured outputs: the bitmask rows of the constrained requests, in logits-row order.
        grammar = sched.structured_output_rows
        mask_rows = [i for i, r in enumerate(reqs) if r.request_id in grammar]
        bitmask = None
        if mask_rows and sched.grammar_bitmask is not None:
            picks = [grammar[reqs[i].request_id] for i in mask_rows]
            bitmask = sched.grammar_bitmask[picks]  # [G, W]
        return SamplingMetadata(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            min_tokens_stop_ids=[
                [
                    *([] if r.params.ignore_eos else r.eos_token_ids),
                    *(r.params.stop_token_ids or []),
                ]
                if r.num_output_tokens < r.params.min_tokens
                else []
                for r in reqs
            ],
            default_generator=self.generator,
            token_bitmask=bitmask,
            token_bitmask_rows=mask_rows if bitmask is not None else [],
        )
