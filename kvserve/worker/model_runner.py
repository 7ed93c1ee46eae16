"""Turns a ``SchedulerOutput`` into one forward pass and a sampled token per finishing row.

The runner owns the physical KV tensors (device and CPU swap) and the model. It flattens
the scheduled tokens of all requests into one batch (no padding between requests), builds
slot mappings and block tables, runs the model, and samples on the rows that reached the end
of their tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.config import AttentionBackend
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.model import cpu_kernels
from kvserve.model.attention import AttentionMetadata, GatherWorkspace
from kvserve.model.llama import LlamaForCausalLM
from kvserve.outputs import Logprob, TokenLogprobs
from kvserve.sample.custom_processors import BatchProcessors, LogitsProcessor
from kvserve.sample.sampler import NoTokenAllowedError, SamplerOutput, SamplingMetadata, sample

logger = logging.getLogger("kvserve.runner")


@dataclass
class StepTimings:
    """Seconds spent in each phase of engine steps (accumulated)."""

    schedule: float = 0.0  # Scheduler.schedule
    prepare: float = 0.0  # building input tensors and metadata (incl. swap copies)
    forward: float = 0.0  # the model's forward pass and logits
    sample: float = 0.0  # the sampler
    output: float = 0.0  # scheduler update, detokenization, stop checks, outputs
    steps: int = 0  # steps measured

    def as_dict(self) -> dict[str, float]:
        return {
            k: getattr(self, k)
            for k in ("schedule", "prepare", "forward", "sample", "output", "steps")
        }


@dataclass
class ModelRunnerOutput:
    """Per sampled request: its token, and logprobs when asked."""

    sampled: dict[str, int]  # request id -> new token id
    sampled_logprob: dict[str, float] = field(default_factory=dict)  # id -> its logprob
    top_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)  # id -> top-n + sampled
    sampled_rank: dict[str, int] = field(default_factory=dict)  # id -> 1-based rank of its token
    # request id -> (index of the first prompt token covered, one TokenLogprobs per prompt token
    # from there): the prompt logprobs computed this step (prompt_logprobs requests only)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> why sampling its row failed (the others' rows were sampled without it)
    failed: dict[str, str] = field(default_factory=dict)

    def update(self, other: ModelRunnerOutput) -> None:
        """Merge the output of a part of the batch (per-request retries)."""
        self.sampled.update(other.sampled)
        self.sampled_logprob.update(other.sampled_logprob)
        self.top_logprobs.update(other.top_logprobs)
        self.sampled_rank.update(other.sampled_rank)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failed.update(other.failed)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * model.head_dim * elem


def _use_decode_kernel(
    backend: AttentionBackend, device: torch.device, dtype: torch.dtype, model: LlamaForCausalLM
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
        model: LlamaForCausalLM,
        block_size: int,
        num_blocks: int,
        num_swap_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        attention_backend: AttentionBackend = AttentionBackend.AUTO,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> None:
        self.model = model
        # custom batch-level logits processors (vLLM v1's interface), built by the engine
        self.batch_processors = BatchProcessors(logits_processors)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        cfg = model.config
        shape = (num_blocks, cfg.num_key_value_heads, block_size, model.head_dim)
        # One (K, V) pair per layer: [num_blocks, Hkv, block_size, D] (see attention.py).
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        swap_shape = (num_swap_blocks, *shape[1:])
        # CPU swap space, same layout; pinned memory would speed GPU copies, plain is fine here.
        self.swap_caches = (
            [
                (torch.empty(swap_shape, dtype=dtype), torch.empty(swap_shape, dtype=dtype))
                for _ in range(cfg.num_hidden_layers)
            ]
            if num_swap_blocks > 0
            else []
        )
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.timings = StepTimings()
        self.workspace = GatherWorkspace()  # decode K/V gather buffers, reused every step
        self.use_decode_kernel = _use_decode_kernel(attention_backend, device, dtype, model)

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
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        for req in sched.scheduled:
            n = sched.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            blocks = sched.block_tables[req.request_id]
            ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if sched.samples(req):
                logits_idx.append(qsl[-1] - 1)
        width = max(len(sched.block_tables[r.request_id]) for r in sched.scheduled)
        table = [
            sched.block_tables[r.request_id] + [0] * (width - len(sched.block_tables[r.request_id]))
            for r in sched.scheduled
        ]
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=torch.tensor(table, dtype=torch.long, device=dev),
            block_size=bs,
        )
        md.split_rows(self.workspace, self.use_decode_kernel)
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            md,
            logits_idx,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, swap: bool = True) -> ModelRunnerOutput:
        """Run one step. ``swap=False`` skips the swap copies: a retry of a failed step must
        not redo them (a swapped-out block may already hold another request's new K/V)."""
        t0 = time.perf_counter()
        if swap:
            self.swap(sched)
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
        rows = _prompt_logprob_rows(sched)
        prompt_lps = self._prompt_logprobs(rows, hidden) if rows else {}
        out = ModelRunnerOutput({})
        if logits is not None:
            out = self._sample(reqs, logits, sched)
        out.prompt_logprobs.update(prompt_lps)
        t3 = time.perf_counter()
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += t3 - t2
        self.timings.steps += 1
        return out

    def _prompt_logprobs(
        self, rows: list[tuple[Request, int, int, int]], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Prompt logprobs from the hidden states of this step's prompt positions (vLLM's
        semantics: log_softmax of the raw logits in float32; each entry holds the prompt's
        own token first, with its rank, then the top ``prompt_logprobs`` with ranks 1..k)."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for req, row, pos, count in rows:
            targets = req.all_token_ids[pos + 1 : pos + 1 + count]
            entries: list[TokenLogprobs] = []
            for s in range(0, count, _PROMPT_LOGPROB_ROWS):
                e = min(count, s + _PROMPT_LOGPROB_ROWS)
                logits = self.model.compute_logits(hidden[row + s : row + e])  # [R, V]
                lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V] float32
                k = min(req.params.prompt_logprobs or 0, lp.shape[1])
                tgt = torch.tensor(targets[s:e], dtype=torch.long, device=lp.device)  # [R]
                chosen = lp.gather(1, tgt.unsqueeze(1))  # [R, 1]
                ranks = (lp >= chosen).sum(dim=-1).tolist()  # vLLM's rank, as the sampler's
                top_v: list[list[float]] = [[] for _ in range(e - s)]
                top_i: list[list[int]] = [[] for _ in range(e - s)]
                if k:
                    values, ids = lp.topk(k, dim=-1)  # [R, k] x 2, descending
                    top_v, top_i = values.tolist(), ids.tolist()
                chosen_lps = chosen.squeeze(1).tolist()
                for j, t in enumerate(targets[s:e]):
                    # The prompt's token first; among the top-k it takes its top-k rank.
                    entry = {t: Logprob(chosen_lps[j], ranks[j])}
                    for r, (v, i) in enumerate(zip(top_v[j], top_i[j], strict=True)):
                        entry[i] = Logprob(v, r + 1)
                    entries.append(entry)
            out[req.request_id] = (pos + 1, entries)
        return out

    def _sample(
        self, reqs: list[Request], logits: torch.Tensor, sched: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Sample one token per row; a failure is narrowed to the rows that cause it."""
        md = self._sampling_metadata(reqs, sched)
        md.batch_processors = self._tell_processors(reqs)
        # Seeded rows: keep their generator states, so that a retry draws the same noise.
        states = [None if g is None else g.get_state() for g in md.generators]
        try:
            return _runner_output(reqs, sample(logits, md))
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
            out.update(_runner_output([r], res))
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


def _runner_output(reqs: list[Request], res: SamplerOutput) -> ModelRunnerOutput:
    out = ModelRunnerOutput(
        {r.request_id: t for r, t in zip(reqs, res.sampled_token_ids, strict=True)}
    )
    if res.sampled_logprobs is not None:
        for i, r in enumerate(reqs):
            if r.params.logprobs is not None:
                out.sampled_logprob[r.request_id] = res.sampled_logprobs[i]
                top = res.top_logprobs[i] if res.top_logprobs else None
                out.top_logprobs[r.request_id] = top or {}
                if res.sampled_ranks is not None:
                    out.sampled_rank[r.request_id] = res.sampled_ranks[i]
    return out


# Prompt logprobs are computed this many positions at a time: a [rows, V] float32 block
# (512 x 49152 x 4 bytes = 96 MiB) instead of one as large as a whole prefill chunk.
_PROMPT_LOGPROB_ROWS = 512


def _prompt_logprob_rows(sched: SchedulerOutput) -> list[tuple[Request, int, int, int]]:
    """(request, its first row in the flat batch, first position, number of positions) of the
    positions whose logits give prompt logprobs this step. Position p predicts prompt token
    p + 1, so the last prompt position (it predicts the first output token) is not one; the
    positions whose token already has its entry (a recompute after preemption) are skipped."""
    rows = []
    offset = 0
    for req in sched.scheduled:
        n = sched.num_scheduled_tokens[req.request_id]
        lps = req.prompt_logprobs
        if lps is not None:
            start = req.num_computed_tokens
            first = max(start, len(lps) - 1)
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > first:
                rows.append((req, offset + first - start, first, end - first))
        offset += n
    return rows
