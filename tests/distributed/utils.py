"""Real gloo ranks in spawned processes for tensor-parallel tests.

Kept light (torch and ``kvserve.distributed`` only): each rank imports this module, and
transformers alone costs seconds per process on this machine."""

from __future__ import annotations

import atexit
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


class _Pool:
    """``world_size`` spawned rank processes kept for the whole test session: each call of
    ``run_ranks`` joins them in a fresh gloo group (a new port) and runs one function.

    Why: a spawned rank imports torch, kvserve and the test module (transformers) before it
    runs anything, 10-25 s of wall time per call on the loaded 2-core box while the work
    itself takes 1-5 s; the tests of this folder made 10 such calls. A pool that saw a
    failure or a timeout is killed (a rank may be stuck in a collective), and the next call
    starts a new one."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_rank_loop, args=(r, world_size, t, self.results), daemon=True)
            for r, t in enumerate(self.tasks)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
        port = free_port()
        for t in self.tasks:
            t.put((port, fn, args))
        out: dict[int, Any] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"tensor-parallel ranks timed out after {RANK_TIMEOUT_S} s "
                    f"(answered: {sorted(out)})"
                ) from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(_close_pools)


def _rank_loop(
    rank: int,
    world_size: int,
    tasks: mp.Queue,  # type: ignore[type-arg]
    results: mp.Queue,  # type: ignore[type-arg]
) -> None:
    """One rank: run each task ``(port, fn, args)`` in a new group until ``None`` comes."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    while (task := tasks.get()) is not None:
        port, fn, args = task
        try:
            tp = init_process_group(rank, world_size, port, "cpu")
            try:
                # Plain pickle: tensors travel as bytes. Put through the queue as they are,
                # torch would share their storage through a socket of this process.
                results.put((rank, True, pickle.dumps(fn(tp, *args))))
            finally:
                destroy_process_group(tp)
        except BaseException:  # reported to the parent, which raises it
            results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(tp, *args)`` in ``world_size`` rank processes (``_Pool``) joined in one gloo
    group; returns each rank's result, in rank order. A rank's exception fails the call with
    its traceback; a rank that does not answer within ``RANK_TIMEOUT_S`` fails it too, and
    every process is killed, so a test never hangs."""
    pool = _POOLS.pop(world_size, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _Pool(world_size)
    try:
        out = pool.run(fn, args)
    except BaseException:
        pool.close()  # a rank may be stuck in a collective the other one left
        raise
    _POOLS[world_size] = pool
    return out
