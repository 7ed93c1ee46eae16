"""The gRPC server of ``kvserve serve --grpc-port P``, on uvicorn's own event loop.

``add_grpc_server(app, state, host, port)`` hooks a ``grpc.aio`` server into the FastAPI app's
lifespan: it starts before uvicorn listens, on the same loop (so the engines' outputs reach
gRPC calls through the same ``call_soon_threadsafe`` hand-off as HTTP requests) and stops when
uvicorn shuts down, after the drain. Beside ``kvserve.v1.Generation`` it serves the standard
``grpc.health.v1.Health`` (SERVING exactly when ``GET /health`` is 200) and server reflection;
those two need no API key, as ``/health`` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvserve.server.app import ServerState
from kvserve.server.grpc import kvserve_pb2 as pb
from kvserve.server.grpc import kvserve_pb2_grpc as pb_grpc
from kvserve.server.grpc.service import GenerationService

logger = logging.getLogger("kvserve.server")

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# How often Watch streams see a change of the server's state (Check reads it on every call).
HEALTH_POLL_SECONDS = 0.5
# gRPC's wait for calls still open when uvicorn has shut down: the drain has already finished
# or failed every request, so only the last messages remain to be sent.
STOP_GRACE_SECONDS = 2.0

ServingStatus = Any  # health_pb2.HealthCheckResponse.ServingStatus (an int enum)


class ServerHealth(health_aio.HealthServicer):
    """The standard health service, reading ``state`` as ``GET /health`` does."""

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self.state = state

    def status(self) -> ServingStatus:
        """NOT_SERVING while loading, draining or with a dead engine (``/health``'s 503s)."""
        state = self.state
        healthy = state.ready and not state.draining
        healthy = healthy and all(e.is_healthy for e in state.engines.values())
        serving = health_pb2.HealthCheckResponse.SERVING
        return serving if healthy else health_pb2.HealthCheckResponse.NOT_SERVING

    async def refresh(self) -> None:
        status = self.status()
        for service in ("", GENERATION_SERVICE):  # "": the whole server, by the protocol
            await self.set(service, status)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()  # the state now, not as of the last poll
        return await super().Check(request, context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.refresh()  # the first message too is the state now
        await super().Watch(request, context)

    async def poll(self) -> None:
        """Keep the statuses current for ``Watch`` streams (the base class pushes on set)."""
        while True:
            await self.refresh()
            await asyncio.sleep(HEALTH_POLL_SECONDS)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_grpc_server(state: ServerState) -> tuple[grpc.aio.Server, ServerHealth]:
    """The gRPC server with its three services (not yet bound or started)."""
    server = grpc.aio.server(
        options=[
            # A busy port must fail: by default gRPC shares it (SO_REUSEPORT) with whoever
            # holds it, and half the calls would go to that other process.
            ("grpc.so_reuseport", 0),
            # --max-request-body-bytes holds for gRPC too (beyond it: RESOURCE_EXHAUSTED).
            ("grpc.max_receive_message_length", state.max_request_body_bytes),
        ]
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationService(state), server)
    health = ServerHealth(state)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server, health


async def start_grpc_server(
    state: ServerState, host: str, port: int
) -> tuple[grpc.aio.Server, asyncio.Task[None], int]:
    """Bind and start; returns the server, its health poller and the bound port (``port`` 0:
    a free one). Raises ``OSError`` when the address cannot be bound."""
    server, health = build_grpc_server(state)
    try:
        bound = server.add_insecure_port(_address(host, port))
    except RuntimeError as e:  # grpc.aio reports a failed bind as RuntimeError
        raise OSError(f"cannot listen for gRPC on {_address(host, port)}: {e}") from e
    if bound == 0:  # older grpcio reports a failed bind as port 0
        raise OSError(f"cannot listen for gRPC on {_address(host, port)}")
    await server.start()
    poller = asyncio.create_task(health.poll(), name="kvserve-grpc-health")
    logger.info("gRPC: %s (%s, health, reflection)", _address(host, bound), GENERATION_SERVICE)
    return server, poller, bound


async def stop_grpc_server(server: grpc.aio.Server, poller: asyncio.Task[None]) -> None:
    poller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await poller
    await server.stop(STOP_GRACE_SECONDS)


def add_grpc_server(
    app: FastAPI,
    state: ServerState,
    host: str,
    port: int,
    on_error: Callable[[str], None] | None = None,
) -> None:
    """Run the gRPC server for the app's lifetime (its lifespan). A failed bind goes to
    ``on_error`` (which stops the server: a clean log line, no lifespan traceback), or
    without one fails the app's start-up."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        started = None
        try:
            started = await start_grpc_server(state, host, port)
        except OSError as e:
            if on_error is None:
                raise
            logger.error("%s; stopping the server", e)
            on_error(str(e))
        try:
            async with inner(a) as value:
                yield value
        finally:
            if started is not None:
                await stop_grpc_server(started[0], started[1])

    app.router.lifespan_context = lifespan
