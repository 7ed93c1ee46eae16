"""``KVServeReplica``: one Serve replica = one engine + the unchanged kvserve FastAPI app.

The ingress forwards each HTTP request as a ``ForwardedRequest`` (method, path, headers,
body) through a streaming handle call; the replica runs it through ``build_app(state)``, the
same ASGI app ``kvserve serve`` runs, and yields the app's ASGI messages back in batches. So
every behaviour of the single-process server (validation, the API key, 400/404/429 bodies
in OpenAI's shape, SSE framing, disconnect aborts) is the replica's, byte for byte; the
ingress only replays messages.

* Batching: the messages an app sends while the previous batch is in transit go out together,
  so a slow hop costs one Ray object per batch, not per token.
* The response start is held back until its first body message: a replica that dies before
  sending anything has sent nothing, and the ingress may retry the request elsewhere.
* Cancelling the handle call (the client went away) is a disconnect for the app, which
  aborts the engine request and frees its KV blocks, as in the single-process server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from starlette.types import Message

from kvserve.engine.arg_utils import EngineArgs
from kvserve.ray.options import replica_threads
from kvserve.server.app import build_app
from kvserve.server.batch_service import RAY_BATCH_OFF, BatchService
from kvserve.server.cli import build_state, load_models
from kvserve.server.responses_store import RAY_STORE_OFF, ResponseStore, StoreLimits

logger = logging.getLogger("kvserve.ray")

REPLICA_HEADER = "x-kvserve-replica"  # the unique id of the replica that answered


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (the body read in full)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope the app sees."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": self.client,
            "server": None,
        }


def is_final(message: Message) -> bool:
    """The last message of a response."""
    return message["type"] == "http.response.body" and not message.get("more_body", False)


class KVServeReplica:
    """The engine deployment's class (``app.py`` wraps it with ``serve.deployment``)."""

    def __init__(self, serve_args: dict[str, Any], model: str | None, name: str | None) -> None:
        from ray import serve

        args = argparse.Namespace(**serve_args)
        threads = replica_threads(args)
        # Before any engine thread exists (kvserve/cli.py: ~20x slower decode otherwise).
        torch.set_num_threads(threads)
        engine_args = replace(
            EngineArgs.from_cli_args(args), model=None, served_model_name=None,
            num_threads=threads,
        )  # fmt: skip
        self.state = build_state(args, engine_args)
        # A later request may reach another replica: no /v1/responses store (RAY_STORE_OFF)
        self.state.responses = ResponseStore(StoreLimits(disabled_reason=RAY_STORE_OFF))
        # and no Batch API: a job's files and state live on one replica's disk (RAY_BATCH_OFF)
        self.state.batches = BatchService(disabled_reason=RAY_BATCH_OFF)
        load_models(self.state, [(model, name)], args, engine_args)
        self.app = build_app(self.state)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.model_name = next(iter(self.state.engines))
        self.batch_interval_s = float(getattr(args, "stream_batching_interval_ms", 0.0)) / 1000
        logger.info("replica %s serves %s (%d threads)", self.replica_id, self.model_name, threads)

    async def served_model(self) -> str:
        return self.model_name

    def check_health(self) -> None:
        """Serve's health check: raising marks this replica unhealthy, and Serve replaces it.
        A dead engine (shut down, or failed steps in a row) cannot serve again."""
        dead = {n: e.dead_reason for n, e in self.state.engines.items() if not e.is_healthy}
        if dead:
            raise RuntimeError(f"kvserve replica {self.replica_id}: dead engines {dead}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve collects this periodically for the router (``RunningReplica.routing_stats``)."""
        stats = {n: e.stats() for n, e in self.state.engines.items()}
        return {
            n: {k: s.get(k) for k in ("num_running", "num_queued", "kv_usage")}
            for n, s in stats.items()
        }

    async def handle(
        self,
        request: ForwardedRequest,
        routing_key: str | None = None,  # read by the router, not here
        replica_id: str | None = None,  # the same
    ) -> AsyncIterator[list[Message]]:
        """Run ``request`` through the app; yield its ASGI messages in batches."""
        queue: asyncio.Queue[Message] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(),
                                                         self.replica_id.encode())]  # fmt: skip
                message = {**message, "headers": headers}
            await queue.put(message)

        task = asyncio.create_task(self.app(request.scope(), receive, send))
        pending: list[Message] = []
        loop = asyncio.get_running_loop()
        last_yield: float | None = None  # the first batch (TTFT) is never held back
        try:
            while True:
                new = await _next_messages(queue, task)
                if not new:  # the app returned without finishing a response
                    if pending:
                        yield pending
                    break
                pending.extend(new)
                if any(m["type"] == "http.response.body" for m in pending):
                    if last_yield is not None and not is_final(pending[-1]):
                        wait = last_yield + self.batch_interval_s - loop.time()
                        if wait > 0:  # --stream-batching-interval-ms: gather a few steps
                            await asyncio.sleep(wait)
                            pending.extend(_drain(queue))
                    batch, pending = pending, []
                    yield batch
                    last_yield = loop.time()
                    if is_final(batch[-1]):
                        break
            await task  # re-raise an app crash (the app answers its own errors with 500)
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: stop the engine thread."""
        state = getattr(self, "state", None)
        if state is not None:
            state.shutdown()


def _drain(queue: asyncio.Queue[Message]) -> list[Message]:
    """The messages waiting in ``queue`` now (maybe none)."""
    messages = []
    while not queue.empty():
        messages.append(queue.get_nowait())
    return messages


async def _next_messages(queue: asyncio.Queue[Message], task: asyncio.Task[None]) -> list[Message]:
    """The messages waiting in ``queue`` (at least one), or [] once ``task`` ended with
    nothing more to send."""
    messages: list[Message] = []
    if queue.empty() and not task.done():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await getter
        if getter.done() and not getter.cancelled():
            messages.append(getter.result())
    while not queue.empty():
        messages.append(queue.get_nowait())
    return messages
