"""Running a batch's lines: each is an in-process HTTP request to the server's own app.

A line goes through exactly what an online request goes through (the guard middleware, the
route, its translation to a ``ValidatedRequest``, the engine), so its answer is the online
endpoint's, errors included; there is no second validation path. The runner only decides
*when* a line is sent:

- at most ``--batch-max-concurrency`` batch requests are in flight (all jobs together);
- a line is sent only while no request waits in its engine's queue (spare capacity: online
  requests that arrive go first, and the engine never queues batch work ahead of them);
- under ``--scheduling-policy priority`` a batch request has priority ``BATCH_PRIORITY``,
  below every online request (which may preempt it).

An answer the server gives because it cannot serve *now* (429 queue full, 503 draining or
loading, 499) is not a result: the line is sent again later (or after a restart).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from kvserve.server.batch_jobs import BatchLine

# The ASGI scope key that marks a request as a batch line (set only here, in-process: no client
# can put a key in a scope), read by the routes (``serving.is_batch_line``).
BATCH_SCOPE_KEY = "kvserve.batch_line"
# below any online request's priority (lower runs first); int64, as the field is
BATCH_PRIORITY = 1 << 62
RETRY_STATUSES = frozenset({429, 499, 503})
RETRY_SECONDS = 0.5  # wait before sending a line the server could not take
SPARE_POLL_SECONDS = 0.02  # how often a line waiting for spare capacity looks again


async def call_app(
    app: ASGIApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` on ``app`` in this process: (status, response body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
        "server": ("kvserve-batch", 0), BATCH_SCOPE_KEY: True,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *headers],
    }  # fmt: skip
    sent = False
    finished = asyncio.Event()
    status, chunks = 500, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the "client" never leaves before the answer
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return status, b"".join(chunks)


def result_record(line: BatchLine, status: int, body: Any) -> dict[str, Any]:
    """One line of OpenAI's batch output format (vLLM's run-batch writes the same)."""
    request_id = body.get("id") if isinstance(body, dict) and status == 200 else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or f"batch_req_{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }


def _line_error(line: BatchLine, message: str, param: str) -> dict[str, Any]:
    err = {"message": message, "type": "invalid_request_error", "param": param, "code": 400}
    return result_record(line, 400, {"error": err})


@dataclass(frozen=True)
class LineSender:
    """How one line reaches the app: its auth header and the priority policy."""

    app: ASGIApp
    api_key: str | None
    priority_scheduling: bool

    def _body(self, line: BatchLine) -> dict[str, Any] | str:
        """The request body to send, or why the line cannot be sent (a 400 result)."""
        body = dict(line.body)
        if body.get("stream"):
            return "stream is not supported in a batch (each line gets one whole answer)"
        if self.priority_scheduling:
            if body.get("priority", 0) != 0:
                return "priority is set by the batch runner (below online requests)"
            body["priority"] = BATCH_PRIORITY
        return body

    async def send(self, line: BatchLine) -> dict[str, Any] | None:
        """The line's result record, or None if the server could not take it now."""
        body = self._body(line)
        if isinstance(body, str):
            return _line_error(line, body, "stream" if "stream" in body else "priority")
        headers = []
        if self.api_key:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        data = json.dumps(body, ensure_ascii=False).encode()
        status, raw = await call_app(self.app, line.url, data, headers)
        if status in RETRY_STATUSES:
            return None
        try:
            answer: Any = json.loads(raw)
        except ValueError:
            answer = {"error": {"message": raw.decode("utf-8", "replace"), "code": status}}
        return result_record(line, status, answer)


async def run_lines(
    lines: list[BatchLine],
    sender: LineSender,
    slots: asyncio.Semaphore,
    commit: Callable[[dict[str, Any]], Awaitable[None]],
    spare: Callable[[BatchLine], bool] = lambda _: True,
) -> None:
    """Send every line (at most ``slots`` at once, each when ``spare(line)``), committing
    each result as it comes; a line the server cannot take yet is retried. Cancelling this
    cancels the lines in flight (their requests are aborted; they have no result)."""

    async def one(line: BatchLine) -> None:
        while (record := await sender.send(line)) is None:
            await asyncio.sleep(RETRY_SECONDS)
        await commit(record)

    tasks: set[asyncio.Task[None]] = set()
    try:
        for line in lines:
            await slots.acquire()
            while not spare(line):
                await asyncio.sleep(SPARE_POLL_SECONDS)
            task = asyncio.create_task(one(line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            # a callback, not a finally: it runs for a task cancelled before it started too
            task.add_done_callback(lambda _: slots.release())
        while tasks:
            await asyncio.gather(*list(tasks))
    finally:
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
