"""``MultiprocExecutor``: one worker process per rank (``spawn``), each building its own
``ModelRunner(config, rank)``.

Each step the driver pickles the step message once and writes it to every worker's pipe;
every rank runs it (with tensor parallelism the ranks meet in the model's collectives) and
rank 0's ``ModelRunnerOutput`` comes back (the other ranks answer None, so a failure on any
rank is seen). The driver waits on each pipe together with its process's sentinel, so a
worker that dies (killed, crashed) turns into a ``WorkerDiedError`` at once instead of a
hang; after that the executor refuses every call. Workers are daemonic, stopped by
``shutdown`` (engine ``close``, garbage collection or interpreter exit), and end by
themselves when the driver's pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from kvserve.config import EngineConfig
from kvserve.executor.abstract import Executor, WorkerDiedError
from kvserve.executor.distributed import free_port
from kvserve.executor.worker import worker_main
from kvserve.worker.runner_output import RunnerInfo

logger = logging.getLogger("kvserve.executor")

# Loading a large model (and building the C++ kernels once, ~20 s) may take minutes; a
# worker that neither answers nor dies within this is reported stuck.
STARTUP_TIMEOUT_S = 1800.0
SHUTDOWN_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        world_size = config.parallel.world_size
        ctx = mp.get_context("spawn")
        port = free_port() if world_size > 1 else 0
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(config, rank, world_size, port, child),
                name=f"kvserve-worker-{rank}", daemon=True,
            )  # fmt: skip
            proc.start()
            child.close()  # the worker holds its end: a dead worker closes the pipe
            self._procs.append(proc)
            self._conns.append(parent)
        # Workers go when the executor is collected or the interpreter exits, whichever first.
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        infos = [self._receive(rank, "start-up", STARTUP_TIMEOUT_S) for rank in range(world_size)]
        self.info: RunnerInfo = infos[0]
        logger.info("%d worker process(es) ready: pids %s", world_size,
                    [p.pid for p in self._procs])  # fmt: skip

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def collective_rpc(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._died(rank, method)
        results = [self._receive(rank, method, None) for rank in range(len(self._conns))]
        return results[0]

    def _receive(self, rank: int, what: str, timeout: float | None) -> Any:
        """Rank ``rank``'s answer; raises its error, or ``WorkerDiedError`` if it died."""
        conn, proc = self._conns[rank], self._procs[rank]
        ready = wait([conn, proc.sentinel], timeout)
        if not ready:
            self._fail(f"worker rank {rank} (pid {proc.pid}) did not answer {what} within "
                       f"{timeout:.0f}s")  # fmt: skip
        if conn in ready or conn.poll():
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                self._died(rank, what)
            if status == "error":
                if what == "start-up":
                    self.shutdown()
                raise payload
            return payload
        self._died(rank, what)

    def _died(self, rank: int, what: str) -> NoReturn:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        self._fail(
            f"worker process rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode}) "
            f"during {what}; the engine cannot continue and must be restarted"
        )

    def _fail(self, reason: str) -> NoReturn:
        self._dead = reason
        logger.error("%s", reason)
        self.shutdown()
        raise WorkerDiedError(reason)

    def shutdown(self) -> None:
        self._finalizer()


def _stop_workers(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask each worker to stop, then make sure: join, terminate, kill (idempotent)."""
    data = pickle.dumps(("shutdown", ()))
    for conn in conns:
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send_bytes(data)
    for proc in procs:
        proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
