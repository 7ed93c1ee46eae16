"""The KV cache's size on CUDA, as vLLM sizes it, and the dummy prefill both it and the
start-up warm-up run.

On CUDA ``gpu_memory_utilization`` (default 0.9 when no other size is given) is vLLM's: the
fraction of the device's *total* memory the engine may use. The KV cache gets what is left of
that after everything already on the device once the weights are loaded (the CUDA context, the
weights, LoRA slots, a draft model, and any other process's memory: ``total - free``) and after
the peak of one dummy step of the largest size the scheduler can send
(``max_num_batched_tokens`` prompt tokens, logits for ``max_num_seqs`` rows in float32 as the
sampler holds them), measured by torch's allocator. Sizing from the free memory before the
weights load (the old meaning here) let ``0.9`` ask for the weights' memory a second time.

Not counted: the CUDA graphs' memory pool, captured after the KV cache exists
(``worker/cuda_graph.py`` logs its measured size), and the allocator's fragmentation; the
headroom of ``1 - gpu_memory_utilization`` covers them, as in vLLM.

On a CPU ``gpu_memory_utilization`` keeps its meaning there (a fraction of MemAvailable at
start-up, ``engine/arg_utils.py``): a CPU has no allocator to profile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata
from kvserve.config import SchedulerConfig
from kvserve.model.base import CausalLM, ForwardBatch, KVCaches
from kvserve.worker.inputs import allocate_kv_caches, kv_bytes_per_block

logger = logging.getLogger("kvserve.runner")

__all__ = ["MemoryProfile", "cuda_kv_bytes", "dummy_prefill", "kv_budget", "profile_cuda_memory"]


@dataclass(frozen=True)
class MemoryProfile:
    """What one CUDA device holds before its KV cache exists (bytes)."""

    total: int  # the device's memory
    used_after_load: int  # total - free once the weights are loaded (every process's)
    activation_peak: int  # the dummy step's peak above what was allocated before it


def kv_budget(utilization: float, profile: MemoryProfile) -> int:
    """Bytes the KV cache may take: ``utilization * total`` minus what is used after the load
    minus the activation peak (negative when nothing is left)."""
    return int(utilization * profile.total) - profile.used_after_load - profile.activation_peak


def dummy_prefill(
    model: CausalLM,
    backend: AttentionBackend,
    kv_caches: KVCaches,
    num_blocks: int,
    block_size: int,
    num_tokens: int,
    max_len: int,
    logits_rows: int = 0,
) -> int:
    """A dummy prefill of up to ``num_tokens`` tokens in ~32-token prompts over blocks 0 up
    (every slot written before it is read; nothing is sampled). Logits are computed for each
    prompt's last token, or for ``logits_rows`` rows (with a float32 softmax, the sampler's
    working set) when that is more. Returns the tokens run."""
    bs = block_size
    row_len = min(bs * max(1, 32 // bs), max_len)  # ~32-token prompts, whole blocks
    per_row = -(-row_len // bs)  # blocks per row
    rows = min(num_tokens // row_len, num_blocks // per_row)
    if rows == 0:
        return 0
    dev = kv_caches[0][0].device
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
    md = backend.build_metadata(md)
    hidden = model(ForwardBatch(ids, pos.repeat(rows), kv_caches, md, backend))  # [T, hidden]
    if logits_rows > rows:
        n = min(logits_rows, hidden.shape[0])
        torch.softmax(model.compute_logits(hidden[:n]).float(), dim=-1)  # [n, V]
    else:
        model.compute_logits(hidden[row_len - 1 :: row_len])  # [rows, V]
    return rows * row_len


def profile_cuda_memory(
    model: CausalLM,
    backend: AttentionBackend,
    kv_caches: KVCaches,
    num_blocks: int,
    block_size: int,
    num_tokens: int,
    max_len: int,
    logits_rows: int,
) -> MemoryProfile:
    """Run the largest dummy step on ``kv_caches`` (a small temporary cache the caller
    made; it counts in the peak, a margin) and read the device's memory around it."""
    dev = kv_caches[0][0].device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        dummy_prefill(model, backend, kv_caches, num_blocks, block_size, num_tokens, max_len,
                      logits_rows)  # fmt: skip
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, used_after_load=total - free, activation_peak=peak)


def cuda_kv_bytes(
    model: CausalLM,
    backend: AttentionBackend,
    utilization: float,
    sched: SchedulerConfig,
    block_size: int,
    dtype: torch.dtype,
    max_len: int,
) -> int:
    """The KV cache's bytes under ``gpu_memory_utilization`` on the model's CUDA device: a
    dummy step of the largest size on a temporary cache just big enough for it, then what
    is left of the device's share. ValueError (with the figures) when not one block fits."""
    device = next(model.parameters()).device
    tokens, bs = sched.max_num_batched_tokens, block_size
    blocks = -(-tokens // bs) + tokens // bs + 2  # every ~32-token row rounded up
    caches = allocate_kv_caches(model, blocks, bs, dtype, device)
    prof = profile_cuda_memory(model, backend, caches, blocks, bs, tokens, max_len,
                               sched.max_num_seqs)  # fmt: skip
    del caches
    torch.cuda.empty_cache()
    budget = kv_budget(utilization, prof)
    gib = 2**30
    logger.info(
        "gpu_memory_utilization %.3g of %.1f GiB on %s: %.2f GiB in use after the load, "
        "%.2f GiB peak of a %d-token dummy step, %.2f GiB for the KV cache", utilization,
        prof.total / gib, device, prof.used_after_load / gib, prof.activation_peak / gib,
        tokens, budget / gib,
    )  # fmt: skip
    if budget < kv_bytes_per_block(model, bs, dtype):
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache on "
            f"{device}: {utilization} of {prof.total / gib:.1f} GiB is "
            f"{utilization * prof.total / gib:.2f} GiB, and {prof.used_after_load / gib:.2f}"
            f" GiB are in use after loading the model, {prof.activation_peak / gib:.2f} GiB"
            " more at the largest step; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens / --max-num-seqs"
        )
    return budget
