"""``OpenAIIngress``: the one HTTP entry point of a kvserve Ray Serve application.

Serve's HTTP proxy hands every request to this deployment's ``__call__``. It reads the body
(up to ``--max-request-body-bytes``), picks the model's engine deployment by the body's
``model``, computes the prompt-prefix routing key (``routing.py``) and calls the replica
that ``KVServeRouter`` picks with a streaming handle call. The replica answers with the ASGI
messages of kvserve's own app, which ``_Replay`` sends on unchanged: status (a full queue's
429 with Retry-After and the OpenAI error body), headers and every SSE chunk.

Faults: a replica that dies before its first message reached the client (its actor killed,
its node gone) costs nothing but time: the request is sent again, up to ``retries`` times,
and the router no longer picks the dead replica. A replica that dies mid-stream ends the
stream with an OpenAI error event and ``[DONE]`` (the client already has part of the answer,
so a silent retry would duplicate text). Serve restarts the dead replica.

Metrics (``/metrics``): the ingress's own per-replica counters (requests by replica and
status, in flight, retries, lost streams) and each known replica's full kvserve scrape with
a ``replica`` label, fetched by requests pinned to that replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client import generate_latest as _generate_latest
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvserve.ray.metrics_merge import merge_scrapes
from kvserve.ray.replica import REPLICA_HEADER, ForwardedRequest, is_final
from kvserve.ray.routing import request_model_and_prompt, routing_key
from kvserve.server.errors import APIError, error_event, error_response
from kvserve.server.serving import SSE_DONE

logger = logging.getLogger("kvserve.ray")

# The replica is gone (not: the request failed on it): worth another replica.
REPLICA_LOST = (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError)
RETRY_BACKOFF_S = 0.2
SCRAPE_TIMEOUT_S = 10.0


class IngressMetrics:
    """The ingress's own Prometheus series, in a registry of their own."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "replica"]
        self.requests = Counter(
            f"{prefix}:ray_requests", "Requests answered, by engine replica and HTTP status.",
            [*labels, "status"], registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            f"{prefix}:ray_requests_in_flight", "Requests being answered, by engine replica.",
            labels, registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            f"{prefix}:ray_request_retries", "Requests sent again after their replica died.",
            ["model_name"], registry=self.registry,
        )  # fmt: skip
        self.lost_streams = Counter(
            f"{prefix}:ray_lost_streams", "Streams ended by an error event: replica died.",
            ["model_name"], registry=self.registry,
        )  # fmt: skip


class OpenAIIngress:
    """The ingress deployment's class (``app.py`` wraps it with ``serve.deployment``)."""

    def __init__(
        self,
        engines: list[DeploymentHandle],
        *,
        max_request_body_bytes: int,
        prefix_routing_chars: int,
        metrics_prefix: str = "kvserve",
        retries: int = 2,
    ) -> None:
        if not engines:
            raise ValueError("OpenAIIngress needs at least one engine deployment")
        self.engines = engines
        self.max_request_body_bytes = max_request_body_bytes
        self.prefix_routing_chars = prefix_routing_chars
        self.retries = retries
        self.metrics = IngressMetrics(metrics_prefix)
        self._names: list[str] | None = None  # served model name per deployment
        self._replicas: list[set[str]] = [set() for _ in engines]  # replica ids seen answering

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return await self._metrics()
        body = await _read_body(request, self.max_request_body_bytes)
        if body is None:
            limit = self.max_request_body_bytes
            return error_response(
                413, f"the request body is larger than this server's limit of {limit} bytes",
                code="request_too_large",
            )  # fmt: skip
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=[(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
            + [(b"content-length", str(len(body)).encode())],
            body=body,
            client=request.scope.get("client"),
        )
        if path == "/health" or (path == "/v1/models" and len(self.engines) > 1):
            return await self._fan_out(forwarded)
        model, prompt = request_model_and_prompt(path, body)
        index = await self._engine_index(model)
        key = routing_key(model, prompt, self.prefix_routing_chars)
        return await self._forward(index, forwarded, key)

    async def _engine_index(self, model: str | None) -> int:
        """The deployment serving ``model`` (the first for no/unknown model: its app answers
        with the first model or an OpenAI 404 listing the served names)."""
        if self._names is None:  # asked once: a deployment's name never changes
            names = await asyncio.gather(*(h.served_model.remote() for h in self.engines))
            self._names = list(names)
        return self._names.index(model) if model in self._names else 0

    async def _open(
        self, index: int, request: ForwardedRequest, key: str | None, pin: str | None = None
    ) -> tuple[DeploymentResponseGenerator, list[Message]]:
        """Start ``request`` on a replica and wait for its first batch (status + first body
        message); a replica lost before it answered is replaced, ``retries`` times."""
        handle = self.engines[index].options(stream=True)
        for attempt in range(self.retries + 1):
            gen = handle.handle.remote(request, routing_key=key, replica_id=pin)
            try:
                return gen, await gen.__anext__()
            except REPLICA_LOST as e:
                gen.cancel()
                if attempt == self.retries:
                    raise
                logger.warning("replica lost before answering (%s); retrying", type(e).__name__)
                self.metrics.retries.labels(self._label(index)).inc()
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        raise AssertionError("unreachable")

    async def _forward(self, index: int, request: ForwardedRequest, key: str | None) -> Response:
        try:
            gen, first = await self._open(index, request, key)
        except StopAsyncIteration:  # path: Anthropic's error shape on /v1/messages
            message = "the engine replica ended without an answer"
            return error_response(502, message, path=request.path)
        except BackPressureError as e:  # Serve's own queue cap (max_queued_requests)
            return error_response(429, str(e), code="rate_limit_exceeded", path=request.path)
        except REPLICA_LOST as e:
            message = f"no engine replica could answer: {type(e).__name__}"
            return error_response(503, message, path=request.path)
        replica = _header(first[0], REPLICA_HEADER) or "unknown"
        self._replicas[index].add(replica)
        labels = (self._label(index), replica)
        self.metrics.in_flight.labels(*labels).inc()
        status = str(first[0].get("status", 0))

        def done() -> None:
            self.metrics.in_flight.labels(*labels).dec()
            self.metrics.requests.labels(*labels, status).inc()

        def lost() -> None:
            self.metrics.lost_streams.labels(self._label(index)).inc()

        return _Replay(first, gen, done, lost)

    async def _fan_out(self, request: ForwardedRequest) -> Response:
        """``/health`` (every model healthy) and ``/v1/models`` (every model's cards)."""
        answers = []
        for index in range(len(self.engines)):
            try:
                gen, first = await self._open(index, request, None)
            except (StopAsyncIteration, *REPLICA_LOST) as e:
                return error_response(503, f"engine deployment {index}: {type(e).__name__}")
            body = b"".join([m.get("body", b"") for m in first] + [
                m.get("body", b"") async for batch in gen for m in batch
            ])  # fmt: skip
            answers.append((first[0], body))
        bad = [(s, b) for s, b in answers if s["status"] != 200]
        if request.path == "/health" or bad:
            start, body = (bad or answers)[0]
            return Response(body, status_code=start["status"], media_type="application/json")
        import json

        cards = [c for _, b in answers for c in json.loads(b)["data"]]
        return Response(json.dumps({"object": "list", "data": cards}),
                        media_type="application/json")  # fmt: skip

    def _label(self, index: int) -> str:
        return self._names[index] if self._names else str(index)

    async def _metrics(self) -> Response:
        """The ingress's series plus every known replica's scrape, labelled ``replica``."""
        scrapes: dict[str, str] = {}
        get = ForwardedRequest(method="GET", path="/metrics")
        for index, seen in enumerate(self._replicas):
            for replica in sorted(seen):
                try:
                    gen, first = await asyncio.wait_for(
                        self._open(index, get, None, pin=replica), SCRAPE_TIMEOUT_S
                    )
                    text = b"".join([m.get("body", b"") for m in first] + [
                        m.get("body", b"") async for batch in gen for m in batch
                    ])  # fmt: skip
                except (TimeoutError, StopAsyncIteration, *REPLICA_LOST):
                    seen.discard(replica)
                    continue
                answered = _header(first[0], REPLICA_HEADER)
                if answered != replica:  # the pinned replica is gone; another answered
                    seen.discard(replica)
                    continue
                scrapes[replica] = text.decode()
        body = _generate_latest(self.metrics.registry) + merge_scrapes(scrapes).encode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)


class _Replay(Response):
    """Sends a replica's ASGI messages to the client as they arrive."""

    def __init__(
        self,
        first: list[Message],
        rest: DeploymentResponseGenerator,
        done: Callable[[], None],
        lost: Callable[[], None],
    ) -> None:
        super().__init__(status_code=first[0].get("status", 200))
        self.first, self.rest, self.done, self.lost = first, rest, done, lost
        content_type = _header(first[0], "content-type") or ""
        self.is_sse = content_type.startswith("text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            for message in self.first:
                await send(message)
                finished = is_final(message)
            async for batch in _batches(self.rest, finished):
                for message in batch:
                    await send(message)
                    finished = is_final(message)
        except REPLICA_LOST as e:
            logger.warning("replica lost mid-response: %s", type(e).__name__)
            self.lost()
            tail = b""
            if self.is_sse:
                reason = f"the engine replica died ({type(e).__name__}); the answer is incomplete"
                error = APIError(503, reason)
                tail = (error_event(error) + SSE_DONE).encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            if not finished:
                self.rest.cancel()  # the client went away: the replica aborts the request
            self.done()


async def _batches(gen: DeploymentResponseGenerator, finished: bool) -> AsyncIterator[list]:
    if finished:
        return
    async for batch in gen:
        yield batch


def _header(start: Message, name: str) -> str | None:
    key = name.encode()
    for k, v in start.get("headers", []):
        if k.lower() == key:
            return bytes(v).decode("latin-1")
    return None


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None once it is larger than ``limit`` bytes."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        return None
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def ingress_deployment(**options: Any) -> Any:
    """``OpenAIIngress`` as a Serve deployment with ``options``."""
    return serve.deployment(OpenAIIngress).options(**options)
