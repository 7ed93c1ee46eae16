"""``MultiprocExecutor``: one worker process per rank (``spawn``), each building its own
``ModelRunner(config, rank)``.

Each step the driver pickles the step message once and writes it to every worker's pipe;
every rank runs it (with tensor parallelism the ranks meet in the model's collectives) and
rank 0's ``ModelRunnerOutput`` comes back (the other ranks answer None, so a failure on any
rank is seen). The driver waits on every pipe together with every process's sentinel, so a
worker that dies (killed, crashed) turns into a ``WorkerDiedError`` at once instead of a
hang, whichever rank it is (the others may be blocked in a collective with it). With more
than one rank an error raised on any rank is fatal too (``RankFailedError``): the other
ranks may wait forever in a collective it never reaches. After either, the workers are
stopped and the executor refuses every call. Workers are daemonic, stopped by ``shutdown``
(engine ``close``, garbage collection or interpreter exit), and end by themselves when the
driver's pipe closes.

A monitor thread also waits on the sentinels between calls, so a worker that dies while the
engine is idle is reported within ``MONITOR_POLL_S`` through ``on_death`` (the engine then
turns unhealthy and the server exits, see docs/scaling.md) instead of at the next request.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from kvserve.config import EngineConfig
from kvserve.distributed.parallel_state import free_port
from kvserve.executor.abstract import Executor, RankFailedError, WorkerDiedError
from kvserve.executor.worker import worker_main
from kvserve.worker.cpu_binding import worker_environment
from kvserve.worker.model_setup import check_tensor_parallel
from kvserve.worker.runner_output import RunnerInfo

logger = logging.getLogger("kvserve.executor")

# Loading a large model (and building the C++ kernels once, ~20 s) may take minutes; a
# worker that neither answers nor dies within this is reported stuck.
STARTUP_TIMEOUT_S = 1800.0
SHUTDOWN_TIMEOUT_S = 10.0
# How often the monitor thread re-checks whether the executor is shutting down; a death is
# seen at once (it waits on the process sentinels), this only bounds the thread's lifetime.
MONITOR_POLL_S = 0.5
# How long a rank's error waits for a peer's exit before it is blamed: a peer killed mid-step
# makes the others' collectives fail, sometimes before its exit is seen (a loaded 2-core box).
# Only the fatal path waits (the engine stops either way).
PEER_DEATH_GRACE_S = 1.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        world_size = config.parallel.world_size
        # What cannot be sharded is refused here, before any process starts or loads.
        check_tensor_parallel(config)
        ctx = mp.get_context("spawn")
        port = free_port() if world_size > 1 else 0
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        self._death_callbacks: list[Callable[[str], None]] = []
        self._stopping = threading.Event()  # set by shutdown: exits are expected from then on
        with worker_environment():
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
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._procs, self._conns, self._stopping
        )
        infos = self._gather("start-up", STARTUP_TIMEOUT_S)
        self.info: RunnerInfo = infos[0]
        self.infos: list[RunnerInfo] = infos
        threading.Thread(
            target=_monitor, args=(weakref.ref(self), self._procs, self._stopping),
            name="kvserve-worker-monitor", daemon=True,
        ).start()  # fmt: skip
        logger.info("%d worker process(es) ready: pids %s", world_size,
                    [p.pid for p in self._procs])  # fmt: skip

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._death_callbacks.append(callback)

    def _report_death(self, rank: int) -> None:
        """The monitor saw rank ``rank`` exit: record why and tell the callbacks (the engine
        thread, idle or not, then stops; a call running now fails by itself)."""
        if self._dead is not None or self._stopping.is_set():
            return  # already reported by a call, or an exit we asked for
        proc = self._procs[rank]
        reason = (
            f"worker process rank {rank} (pid {proc.pid}) died (exit code {_exit_code(proc)}); "
            "the engine cannot continue and must be restarted"
        )
        self._dead = reason
        logger.error("%s", reason)
        for callback in self._death_callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("worker death callback failed")

    def collective_rpc(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._died(rank, method)
        return self._gather(method, None)[0]

    def _gather(self, what: str, timeout: float | None) -> list[Any]:
        """Every rank's answer to ``what``, in rank order. Waits on all pipes and all
        processes at once: the first error or death ends the wait (see the module doc)."""
        pending = dict(enumerate(self._conns))
        results: list[Any] = [None] * len(self._conns)
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout)
            if not ready:
                self._fail(f"worker rank(s) {sorted(pending)} did not answer {what} within "
                           f"{timeout:.0f}s")  # fmt: skip
            for rank, conn in list(pending.items()):
                if conn not in ready and not conn.poll():
                    continue
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._died(rank, what)
                del pending[rank]
                if status == "error":
                    self._raise(rank, what, payload)
                results[rank] = payload
            for sentinel, rank in sentinels.items():
                if sentinel in ready:
                    self._died(rank, what)  # it exited without (or after) answering
        return results

    def _raise(self, rank: int, what: str, exc: BaseException) -> NoReturn:
        """Rank ``rank`` raised ``exc``: at start-up the workers stop and ``exc`` is raised
        (a config or load error); later, a single rank's error is raised as it is (the
        executor goes on), and with several ranks it is a ``RankFailedError`` (fatal, see
        the module doc)."""
        if what == "start-up":
            self.shutdown()
            raise exc
        if len(self._conns) == 1:
            raise exc
        # A rank's collective fails when a peer dies mid-step (gloo: connection reset), and
        # that error can arrive before the peer's exit is seen: name the dead peer, the cause.
        others = {p.sentinel: r for r, p in enumerate(self._procs) if r != rank}
        dead = wait(list(others), PEER_DEATH_GRACE_S)
        if dead:
            self._died(others[dead[0]], what)
        reason = (
            f"rank {rank} of {len(self._conns)} failed during {what}: {exc!r}; under tensor "
            "parallelism a failed step is not retried per request (the ranks' collectives "
            "would fall out of step), so the engine cannot continue and must be restarted"
        )
        self._dead = reason
        logger.error("%s", reason)
        self.shutdown()
        raise RankFailedError(reason) from exc

    def _died(self, rank: int, what: str) -> NoReturn:
        proc = self._procs[rank]
        self._fail(
            f"worker process rank {rank} (pid {proc.pid}) died (exit code {_exit_code(proc)}) "
            f"during {what}; the engine cannot continue and must be restarted"
        )

    def _fail(self, reason: str) -> NoReturn:
        self._dead = reason
        logger.error("%s", reason)
        self.shutdown()
        raise WorkerDiedError(reason)

    def shutdown(self) -> None:
        self._finalizer()


def _exit_code(proc: BaseProcess, timeout: float = 5.0) -> int | None:
    """The exit code of a worker whose pipe closed (so it is exiting), once it is reaped (1 s
    was too short on a loaded 2-core box). The monitor thread may reap it at the same moment:
    then this thread's waitpid fails (ECHILD) and join returns with no code, which the Process
    shows a moment later (the message said "exit code None" in 3 of 4 runs of the executor
    tests side by side): wait for it too."""
    deadline = time.monotonic() + timeout
    proc.join(timeout=timeout)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.exitcode


def _monitor(
    executor: weakref.ref[MultiprocExecutor], procs: list[BaseProcess], stopping: threading.Event
) -> None:
    """Wait on the workers' sentinels until one exits or the executor shuts down. Holds the
    executor only weakly, so garbage collection still shuts it down."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while not stopping.is_set():
        ready = wait(list(sentinels), MONITOR_POLL_S)
        if ready and not stopping.is_set():
            owner = executor()
            if owner is not None:
                owner._report_death(sentinels[ready[0]])  # type: ignore[index]
            return


def _stop_workers(
    procs: list[BaseProcess], conns: list[Connection], stopping: threading.Event
) -> None:
    """Ask each worker to stop, then make sure: join, terminate, kill (idempotent)."""
    stopping.set()
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
