"""Compile lanes: a FIFO of grammar compiles run one at a time by a killable worker process.

A lane's thread sends a compile to its worker and watches it every ``POLL_SECONDS``: past
the time limit, past the memory limit (the worker's resident memory above what it had when
ready), or once nobody waits for the result, the worker is killed (SIGKILL: xgrammar cannot
be interrupted), the job fails with a ``GrammarError`` naming the flag, and a fresh worker
is forked for the next job. The grammar server keeps two lanes (small and large inputs), so
a small ``guided_choice`` never queues behind a 10,000-tool schema.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvserve.structured_output.params import GrammarError, StructuredOutputsParams

logger = logging.getLogger("kvserve.grammar")

POLL_SECONDS = 0.05  # how often a running compile's time, memory and waiters are checked
# The first worker starts the zygote, which imports xgrammar and torch (~6 s on a busy 2-core
# machine); later workers fork in well under a second.
WORKER_START_TIMEOUT = 120.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class CompileLimits:
    timeout: float  # seconds one compile may run (--grammar-compile-timeout)
    max_memory: int  # bytes one compile may add to its worker (--grammar-compile-max-memory)


class LimitError(GrammarError):
    """A compile killed at a limit (not the input's fault as a compile error is)."""


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``future`` unless it already is (a job cancelled while its answer came)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class CompileJob:
    """One compile: its params and the future of its ``xgrammar.CompiledGrammar``."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.future: Future[Any] = Future()
        self.cancelled = False  # set (under the lane's lock) once nobody waits for it


class _Zygote:
    """The process that forks compile workers (``compile_worker.zygote_main``); one per
    server process, started with the first worker."""

    _lock = threading.Lock()
    _current: _Zygote | None = None

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair()
        fd = theirs.fileno()
        code = "from kvserve.structured_output.compile_worker import main; main()"
        cmd = [sys.executable, "-c", code, str(fd)]
        self.proc = subprocess.Popen(cmd, pass_fds=[fd], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock.settimeout(WORKER_START_TIMEOUT)  # the first answer waits for the imports

    @classmethod
    def fork(cls) -> tuple[int, Connection]:
        """A new worker: its pid and the server's end of its socket."""
        with cls._lock:
            if cls._current is None or cls._current.proc.poll() is not None:
                cls._current = _Zygote()
            zygote = cls._current
            try:
                zygote.sock.sendall(b"f")
                msg, fds, _, _ = socket.recv_fds(zygote.sock, 4, 1)
            except OSError:
                zygote.proc.kill()  # stuck or gone: the next fork starts another
                cls._current = None
                raise
            if len(msg) != 4 or len(fds) != 1:
                zygote.proc.kill()
                cls._current = None
                raise RuntimeError("the grammar compile zygote exited")
        return struct.unpack("i", msg)[0], Connection(fds[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Worker:
    """A forked compile process, ready (the tokenizer info loaded) once constructed."""

    def __init__(self, info_json: str) -> None:
        self.pid, self.conn = _Zygote.fork()
        try:
            self.conn.send(info_json)
            if not self.conn.poll(WORKER_START_TIMEOUT):
                raise RuntimeError(f"no answer in {WORKER_START_TIMEOUT:g} s")
            self.conn.recv()  # ("ready", pid)
        except BaseException:
            self.kill()
            raise
        self.baseline = rss_bytes(self.pid) or 0

    def grown(self) -> int:
        """Bytes of resident memory gained since the worker was ready (0 if unknown)."""
        rss = rss_bytes(self.pid)
        return 0 if rss is None else max(0, rss - self.baseline)

    def alive(self) -> bool:
        return _alive(self.pid)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone: every byte the compile built is back with the
        OS (the zygote reaps it)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.conn.close()


class CompileLane:
    """One worker process and the FIFO of jobs it compiles, one at a time."""

    def __init__(
        self,
        name: str,
        info: Callable[[], Any],
        limits: CompileLimits,
        decode: Callable[[str], Any],
        replay: Callable[[StructuredOutputsParams], Any],
    ) -> None:
        self.name = name
        self.limits = limits
        self._info = info  # the xgrammar.TokenizerInfo (built once, on first use)
        self._decode = decode  # serialized grammar -> CompiledGrammar
        self._replay = replay  # params -> CompiledGrammar, compiled in this thread
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._worker: _Worker | None = None
        self._warm = False  # start the worker before any job comes
        self._closed = False
        self.killed = 0  # workers killed at a limit or cancelled (tests, logs)
        self._thread = threading.Thread(target=self._run, name=f"kvserve-grammar-{name}")
        self._thread.daemon = True
        self._thread.start()

    @property
    def worker_pid(self) -> int | None:
        w = self._worker
        return None if w is None else w.pid

    def submit(self, job: CompileJob) -> None:
        with self._cond:
            if self._closed:
                _settle(job.future, exc=GrammarError("the grammar compiler is shut down"))
                return
            self._queue.append(job)
            self._cond.notify()

    def warm_up(self) -> None:
        """Start the worker now (in the lane's thread), so the first compile does not wait."""
        with self._cond:
            self._warm = True
            self._cond.notify()

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for ``job``: drop it if queued, kill its worker if it runs."""
        with self._cond:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
        job.future.cancel()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs = list(self._queue)
            self._queue.clear()
            self._cond.notify()
        for job in jobs:
            job.future.cancel()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed and not self._warm:
                    self._cond.wait()
                if self._closed:
                    break
                self._warm = False
                job = self._queue.popleft() if self._queue else None  # never a cancelled one
            try:
                worker = self._ensure_worker()
            except Exception as e:
                logger.error("grammar compile worker (%s lane) failed to start: %s", self.name, e)
                if job is not None:
                    _settle(job.future, exc=GrammarError(f"the grammar compiler failed: {e}"))
                continue
            if job is not None:
                self._compile(worker, job)
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def _ensure_worker(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker(self._info().serialize_json())
            logger.info(
                "grammar compile worker pid %d started (%s lane)", self._worker.pid, self.name
            )
        return self._worker

    def _kill(self, worker: _Worker, why: str) -> None:
        # counted first: whoever sees the worker gone also sees it counted
        self.killed += 1
        worker.kill()
        with self._cond:
            self._worker = None
            self._warm = True  # fork the next worker now, not when the next job comes
        logger.warning(
            "killed grammar compile worker pid %d (%s lane): %s", worker.pid, self.name, why
        )

    def _compile(self, worker: _Worker, job: CompileJob) -> None:
        """Run ``job`` on ``worker`` under the limits; settle its future either way."""
        kind = job.params.kind
        worker.conn.send(job.params)
        stopped = self._watch(worker, job)
        if stopped is not None:  # (why the worker was killed, the request's error or None)
            why, error = stopped
            self._kill(worker, why)
            if error is not None:
                _settle(job.future, exc=LimitError(f"compiling this {kind} constraint {error}"))
            return
        try:
            status, payload = worker.conn.recv()
        except (EOFError, OSError):
            self._kill(worker, "it died")
            _settle(job.future, exc=LimitError(f"the grammar compiler died on this {kind}"))
            return
        if worker.grown() > self.limits.max_memory // 2:
            # What the compile allocated may stay with the worker (malloc keeps freed pages):
            # start afresh rather than carry it into the next compile's budget.
            self._kill(worker, "recycled: it kept more than half of --grammar-compile-max-memory")
        if status == "error":
            _settle(job.future, exc=GrammarError(payload))
            return
        try:
            grammar = self._replay(job.params) if status == "replay" else self._decode(payload)
            _settle(job.future, grammar)
        except Exception as e:  # cannot happen (one install, a deterministic compiler)
            _settle(job.future, exc=GrammarError(f"the compiled {kind} could not be read: {e}"))

    def _watch(self, worker: _Worker, job: CompileJob) -> tuple[str, str | None] | None:
        """Wait for the worker's answer; None once it is there, else why to kill the worker
        and the error for the request (None: cancelled, nobody to tell)."""
        timeout, max_memory = self.limits.timeout, self.limits.max_memory
        deadline = time.monotonic() + timeout
        while not worker.conn.poll(POLL_SECONDS):
            with self._cond:
                cancelled = job.cancelled
            if cancelled:
                return "compile cancelled, no request waits for it any more", None
            if time.monotonic() > deadline:
                return (
                    f"compile ran past --grammar-compile-timeout {timeout:g} s",
                    f"took longer than {timeout:g} s (--grammar-compile-timeout); simplify it",
                )
            if worker.grown() > max_memory:
                mib = f"{max_memory / 2**20:g} MiB"
                return (
                    f"compile needed more than --grammar-compile-max-memory {mib}",
                    f"needed more than {mib} (--grammar-compile-max-memory); simplify it",
                )
            if not worker.alive():
                return "it died", "crashed the compiler"
        return None
