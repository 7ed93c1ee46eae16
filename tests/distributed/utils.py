"""Real gloo ranks in spawned processes for tensor-parallel tests.

Kept light (torch and ``kvserve.distributed`` only): each rank imports this module, and
transformers alone costs seconds per process on this machine."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kvserve.distributed.parallel_state import (
    destroy_process_group,
    init_process_group,
)

# A rank that has not answered by then is stuck (a collective waiting on a dead rank): the
# test fails instead of hanging. Loading the built-in model on 3 ranks over 2 cores is the
# slowest case (~1 min).
RANK_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: mp.Queue,  # type: ignore[type-arg]
) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        tp = init_process_group(rank, world_size, port, "cpu")
        try:
            # Plain pickle: tensors travel as bytes. Put through the queue as they are, torch
            # would share their storage through a socket of this process, gone once it exits.
            results.put((rank, True, pickle.dumps(fn(tp, *args))))
        finally:
            destroy_process_group(tp)
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(tp, *args)`` in ``world_size`` spawned processes joined in one gloo group;
    returns each rank's result, in rank order. A rank's exception fails the call with its
    traceback; a rank that does not answer within ``RANK_TIMEOUT_S`` fails it too, and every
    process is killed, so a test never hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"tensor-parallel ranks timed out after {RANK_TIMEOUT_S} s "
                    f"(answered: {sorted(out)})"
                ) from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
