"""OpenAI's Files and Batch routes (``/v1/files``, ``/v1/batches``) over ``BatchService``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.batch_files import check_upload, parse_multipart
from kvserve.server.errors import bad_request
from kvserve.server.openapi import error_responses

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

MAX_LIST_LIMIT = 100  # OpenAI's bound on a list page


def add_batch_routes(app: FastAPI, state: ServerState) -> None:
    """The routes, and the batch loop for the app's lifetime (its lifespan)."""
    service = state.batches
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        service.start(a, state)
        try:
            async with inner(a) as value:
                yield value
        finally:
            await service.stop()

    app.router.lifespan_context = lifespan
    _add_file_routes(app, state)

    @app.post("/v1/batches", responses=error_responses(400, 404, 429))
    async def create_batch(raw: Request) -> JSONResponse:
        body = await _json_object(raw)
        return JSONResponse(service.create(body))

    @app.get("/v1/batches", responses=error_responses(404))
    async def list_batches(
        limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT), after: str | None = None
    ) -> JSONResponse:
        return JSONResponse(service.list(limit, after))

    @app.get("/v1/batches/{batch_id}", responses=error_responses(404))
    async def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(service.get(batch_id).to_openai())

    @app.post("/v1/batches/{batch_id}/cancel", responses=error_responses(400, 404))
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(service.cancel(batch_id))


def _add_file_routes(app: FastAPI, state: ServerState) -> None:
    service = state.batches

    @app.post("/v1/files", responses=error_responses(400, 413))
    async def upload_file(raw: Request) -> JSONResponse:
        upload = parse_multipart(raw.headers.get("content-type", ""), await raw.body())
        filename, data, purpose = check_upload(upload, service.limits)
        # off the event loop: a large file's write and fsync take a while
        obj = await asyncio.to_thread(service.files.create, data, filename, purpose)
        return JSONResponse(obj)

    @app.get("/v1/files", responses=error_responses(400))
    async def list_files(purpose: str | None = None) -> JSONResponse:
        files = service.files.list(purpose)
        return JSONResponse({"object": "list", "data": files, "has_more": False})

    @app.get("/v1/files/{file_id}", responses=error_responses(404))
    async def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(service.files.get(file_id))

    @app.get("/v1/files/{file_id}/content", responses=error_responses(404))
    async def file_content(file_id: str) -> Response:
        data = await asyncio.to_thread(service.files.content, file_id)
        return Response(data, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", responses=error_responses(400, 404))
    async def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(service.delete_file(file_id))


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        body = await raw.json()
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body
