"""A worker process: one rank's ``ModelRunner``, driven over a pipe by ``MultiprocExecutor``.

Protocol (one pipe per worker, requests pickled once by the driver): the worker first sends
``("ready", RunnerInfo)`` or ``("error", exception)``; then for each request ``(method,
args)`` it calls ``ModelRunner.<method>(*args)`` and answers ``("ok", result)`` (rank 0's
result; other ranks answer None) or ``("error", exception)``. ``("shutdown", ())`` or a
closed pipe (the driver went away) ends the process, after leaving the process group.

Everything runs in the process's main thread: torch's thread count and the rank's cores
(``--cpu-cores``) are set there, before the model loads, and the same thread runs every step
(libgomp's thread pool belongs to the thread that starts it). ``OMP_WAIT_POLICY`` was set in
the environment the driver spawned the process with (``multiproc.py``): libgomp reads it once,
when ``import torch`` loads it, before any code of this module runs.
"""

from __future__ import annotations

import logging
import pickle
from multiprocessing.connection import Connection
from typing import Any

from kvserve.config import EngineConfig

logger = logging.getLogger("kvserve.worker")


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it crosses the pipe, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def worker_main(
    config: EngineConfig, rank: int, world_size: int, port: int, conn: Connection
) -> None:
    """The worker process's entry point (spawned: imports start from scratch)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    tp = None
    try:
        from kvserve.distributed.parallel_state import destroy_process_group, init_process_group
        from kvserve.executor.uniproc import set_num_threads
        from kvserve.worker.model_runner import ModelRunner

        # Before anything starts a thread: the whole process is confined to the rank's cores
        # and each OpenMP thread pinned to one (--cpu-cores), so what it starts later inherits.
        set_num_threads(config.parallel, rank, worker=True)
        tp = init_process_group(rank, world_size, port, config.device)
        runner = ModelRunner(config, tp=tp)
    except BaseException as exc:  # reported to the driver, which raises it
        conn.send(("error", _picklable(exc)))
        return
    conn.send(("ready", runner.info))
    try:
        _serve(runner, rank, conn)
    finally:
        del runner
        destroy_process_group(tp)


def _serve(runner: Any, rank: int, conn: Connection) -> None:
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        if method == "shutdown":
            return
        try:
            result = getattr(runner, method)(*args)
            conn.send(("ok", result if rank == 0 else None))
        except Exception as exc:
            logger.exception("rank %d: %s failed", rank, method)
            conn.send(("error", _picklable(exc)))
