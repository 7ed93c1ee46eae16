"""``init_worker_distributed``: two spawned ranks join one gloo group and all-reduce."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from kvserve.executor.distributed import free_port, init_worker_distributed


def _rank(rank: int, port: int, results: Any) -> None:
    group = init_worker_distributed(rank, 2, port, "cpu")
    x = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(x, group=group)
    results.put((rank, torch.distributed.get_world_size(), float(x)))
    torch.distributed.destroy_process_group()


def test_two_ranks_all_reduce_over_gloo() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, 2, 3.0), (1, 2, 3.0)]
    assert [p.exitcode for p in procs] == [0, 0]


def test_one_rank_needs_no_group() -> None:
    assert init_worker_distributed(0, 1, 0) is None
    assert not torch.distributed.is_initialized()
