"""Graceful drain on SIGTERM / SIGINT, bounded by ``--shutdown-timeout`` (vLLM's flag).

Plain uvicorn closes the listening socket at once, cuts the streams still running after its
``timeout_graceful_shutdown`` (no error event, no ``[DONE]``) and then re-raises the signal, so
the process dies by it (exit 143) before the engines are shut down. ``DrainingServer`` instead:

1. marks the server as draining: the socket stays open, new API requests get 503 and
   ``/health`` 503 "draining" (``GuardMiddleware`` and the health route read the flag);
2. waits up to the timeout for the requests in flight to finish;
3. fails the rest through the engines (``abort_all``), so streams end with an error event
   and ``data: [DONE]`` and non-streaming requests get a 503 body;
4. only then lets uvicorn shut down, without re-raising the signal: ``run()`` returns, the
   caller's shutdown code (``ServerState.shutdown``) runs and the process exits with 0.

A second signal during the drain forces an immediate exit, as uvicorn's ``force_exit`` does.

An engine that dies while serving (a tensor-parallel worker killed, even while idle: the
executor's monitor reports it within a second) stops the server the same way, with no wait:
``/health`` answers 503 with the reason at once, the requests in flight are failed, and
``run()`` returns with ``state.fatal_error`` set, so the process exits with code 1 and a
supervisor (systemd, Kubernetes, Ray) restarts it, as vLLM's API server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from types import FrameType

import uvicorn

from kvserve.engine.async_engine import EngineDeadError
from kvserve.server.app import SHUTTING_DOWN, ServerState

logger = logging.getLogger("kvserve.server")

# uvicorn's own wait once the drain is over: idle keep-alive connections and the last bytes of
# responses already failed. Short, since every request has been finished or failed by then.
UVICORN_GRACE_SECONDS = 3
# After the abort: how long the handlers get to send their error events and ``[DONE]``.
ABORT_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.05
# On a forced exit: how long the app's lifespan shutdown may take (uvicorn would skip it).
FORCED_LIFESPAN_SECONDS = 1.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose SIGTERM / SIGINT drains ``state``'s requests first."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task[None] | None = None
        self._forced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler, run between two bytecodes of the event loop's thread: only plain
        # assignments here (no logging, no loop calls); the drain starts on the next tick.
        # The signal is deliberately not recorded in ``_captured_signals``: uvicorn would
        # re-raise it after ``serve()`` and the process would die before its shutdown code.
        if self.state.draining or self.should_exit:
            self.force_exit = True  # the second signal: stop now
            self.should_exit = True
            return
        self.state.draining = True  # new API requests get 503 from here on

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop calls this every 0.1 s: the first point after a signal where
        # starting a task is safe.
        if self.state.ready and self.state.fatal_error is None and not self.force_exit:
            self._check_engines()
        if self.state.draining and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="kvserve-drain")
        if self.force_exit and not self._forced:
            self._forced = True  # uvicorn now skips its waits; stop the engines' work too
            logger.warning("second signal: exiting now, aborted %d requests", self._abort_all())
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the lifespan shutdown on a forced exit; the lifespan task is then
            # cancelled at loop close and logs a CancelledError traceback that reads like a
            # crash. Finishing it, briefly, keeps a forced exit's log clean.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.lifespan.shutdown(), FORCED_LIFESPAN_SECONDS)

    def _check_engines(self) -> None:
        """An engine that died makes the whole server exit (see the module doc)."""
        dead = {n: e.dead_reason for n, e in self.state.engines.items() if not e.is_healthy}
        if not dead:
            return
        self.state.fatal_error = f"engine died, the server is exiting: {dead}"
        logger.error(
            "%s; failing the requests in flight and exiting with code 1 so that a supervisor "
            "restarts the server", self.state.fatal_error,
        )  # fmt: skip
        self.shutdown_timeout = 0.0  # nothing can finish on a dead engine: fail them now
        self.state.draining = True

    def _in_flight(self) -> int:
        """HTTP requests and gRPC calls being answered. uvicorn's request tasks, not the
        engines' requests: they also cover a request between the guard and the engine
        (tokenizing) and a stream whose engine request is done but whose last chunks are
        still being sent."""
        return len(self.server_state.tasks) + self.state.grpc_in_flight

    def _engine_requests(self) -> int:
        return sum(e.num_unfinished_requests() for e in self.state.engines.values())

    def _abort_all(self) -> int:
        # the handlers answer it with 503; after an engine died, the client is told so
        error = EngineDeadError(self.state.fatal_error or SHUTTING_DOWN)
        return sum(e.abort_all(error) for e in self.state.engines.values())

    async def _drain(self) -> None:
        start = time.monotonic()
        deadline = start + self.shutdown_timeout
        logger.info(
            "draining: %d HTTP requests / gRPC calls in flight (%d in the engines); new ones "
            "get 503; waiting up to %gs (--shutdown-timeout)",
            self._in_flight(), self._engine_requests(), self.shutdown_timeout,
        )  # fmt: skip
        while self._in_flight() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(POLL_SECONDS)
        if self._in_flight() and not self.force_exit:
            aborted = self._abort_all()
            logger.warning(
                "shutdown timeout (%gs) reached: aborted %d requests still running",
                self.shutdown_timeout, aborted,
            )  # fmt: skip
            # Keep aborting: a request that passed the guard before the drain began may reach
            # its engine only now. Its handler then sends the error event or the 503 body.
            grace = time.monotonic() + ABORT_GRACE_SECONDS
            while self._in_flight() and time.monotonic() < grace and not self.force_exit:
                await asyncio.sleep(POLL_SECONDS)
                self._abort_all()
        if self.force_exit:
            return  # on_tick has taken over
        logger.info("drained in %.1fs; shutting down", time.monotonic() - start)
        self.should_exit = True
