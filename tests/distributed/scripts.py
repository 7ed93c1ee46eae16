"""A scripted prefill + greedy decode over a paged KV cache that a TP=1 model and every
tensor-parallel rank run alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.config import LoRAConfig
from kvserve.distributed.layers import RowParallelLinear, row_parallel_with
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.lora.manager import LoRAManager
from kvserve.lora.punica import LoRAMapping
from kvserve.lora.request import LoRARequest
from kvserve.lora.sharding import shard_pair
from kvserve.model.base import CausalLM, ForwardBatch
from kvserve.model.loader import load_model
from kvserve.ops import cpu_kernels
from kvserve.worker.inputs import allocate_kv_caches, build_metadata


@dataclass(frozen=True)
class Script:
    """A batch of prompts prefilled together, then ``decode_steps`` greedy steps."""

    prompts: list[list[int]]
    decode_steps: int
    block_size: int = 4  # small: every prompt spans several blocks
    dtype: torch.dtype = torch.float32
    use_kernel: bool = False  # decode attention through the C++ kernel (else SDPA)
    prepack: bool = False
    fused_ops: bool = False


def load(path: Path, script: Script, tp: TPGroup | None) -> CausalLM:
    return load_model(
        path,
        script.dtype,
        "cpu",
        max_positions=256,
        prepack=script.prepack,
        fused_ops=script.fused_ops,
        tp=tp,
    )


def run_script(
    model: CausalLM,
    script: Script,
    tp: TPGroup | None,
    lora: Callable[[list[int]], LoRAMapping | None] | None = None,
) -> list[torch.Tensor]:
    """The logits (float32, ``[requests, vocab]``) of each step: the prefill's last rows,
    then each decode step's. Rank 0 picks the greedy tokens and broadcasts them, as the
    driver of a tensor-parallel engine does; other ranks return an empty list. ``lora``:
    the step's adapter mapping from each request's token count (``LoRAManager.prepare``)."""
    n = len(script.prompts)
    bs = script.block_size
    per_req = -(-(max(map(len, script.prompts)) + script.decode_steps) // bs)
    # Interleaved block ids: each request's blocks are scattered through the cache.
    tables = [[1 + r + n * j for j in range(per_req)] for r in range(n)]
    kv = allocate_kv_caches(model, 1 + n * per_req, bs, script.dtype, torch.device("cpu"))
    backend = (CpuKernelBackend if script.use_kernel else TorchSDPABackend)(torch.device("cpu"))
    # Loads the C++ kernels (built once into $TORCH_EXTENSIONS_DIR), as the runner does.
    assert not script.use_kernel or cpu_kernels.available(), "the C++ CPU kernels did not build"
    driver = tp is None or tp.is_driver
    steps: list[torch.Tensor] = []
    lens = [len(p) for p in script.prompts]
    rows = [(tables[r], 0, lens[r]) for r in range(n)]
    ids = torch.tensor([t for p in script.prompts for t in p])
    with torch.no_grad():
        for step in range(script.decode_steps + 1):
            md, positions = build_metadata(rows, bs, torch.device("cpu"))
            md = backend.build_metadata(md)
            counts = lens if step == 0 else [1] * n
            mapping = None if lora is None else lora(counts)
            hidden = model(ForwardBatch(ids, positions, kv, md, backend, lora=mapping))
            last = torch.tensor(md.query_start_loc[1:]) - 1
            logits = model.compute_logits(hidden[last])  # [n, V] on the driver
            tokens = torch.zeros(n, dtype=torch.long)
            if driver:
                assert logits is not None
                steps.append(logits.float())
                tokens = logits.argmax(-1)
            else:
                assert logits is None
            if tp is not None and tp.world_size > 1:
                torch.distributed.broadcast(tokens, src=0, group=tp.group)
            rows = [(tables[r], lens[r] + step, 1) for r in range(n)]
            ids = tokens
    return steps


def sharded_logits(tp: TPGroup, path: Path, script: Script) -> dict[str, Any]:
    """What one rank reports: its KV cache's head count and (rank 0) the logits."""
    model = load(path, script, tp)
    steps = run_script(model, script, tp)
    return {"num_kv_heads": model.num_kv_heads, "logits": steps}


def lora_tokens(
    tp: TPGroup | None, path: Path, script: Script, adapters: list[Path | None]
) -> list[torch.Tensor]:
    """``run_script`` with request ``i`` on adapter ``adapters[i]`` (None: the base model),
    all in one batch, through a ``LoRAManager`` of this rank (its slice of each adapter)."""
    model = load(path, script, tp)
    folders = sorted({str(a) for a in adapters if a is not None})
    config = LoRAConfig(max_loras=len(folders), max_lora_rank=16)
    manager = LoRAManager(model, config, script.dtype, torch.device("cpu"), tp or SINGLE)
    reqs = {f: LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)}
    for req in reqs.values():
        manager.add(req)
    rows = [None if a is None else reqs[str(a)] for a in adapters]
    return run_script(model, script, tp, lambda counts: manager.prepare(rows, counts))


def row_parallel_lora(tp: TPGroup, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``RowParallelLinear`` with a bias (prepacked or not) on this rank's input slice,
    plus the delta of this rank's A columns added before the all-reduce
    (``row_parallel_with``); returns that output and the whole layer's plus the whole
    delta, computed alike on every rank (same seed)."""
    torch.manual_seed(0)
    full = nn.Linear(16, 8)
    x, a, b = torch.randn(3, 16), torch.randn(4, 16), torch.randn(8, 4)
    layer = RowParallelLinear(16, 8, True, tp)
    layer.weight_loader(layer.weight, full.weight.detach())
    layer.weight_loader(layer.bias, full.bias.detach())
    run: nn.Module = layer.packed() if packed else layer
    ar, br = shard_pair("o_proj", a, b, tp.rank, tp.world_size)
    xr = x.chunk(tp.world_size, dim=1)[tp.rank]  # [3, 16 / world]
    with torch.no_grad():
        got = row_parallel_with(run, xr, lambda y: y + xr @ ar.t() @ br.t())
        want = full(x) + x @ a.t() @ b.t()
    return got, want
