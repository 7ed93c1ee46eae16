"""OpenAI's Files and Batch routes (``/v1/files``, ``/v1/batches``) over ``BatchService``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from kvserve.server.batch_files import check_upload, parse_multipart
from kvserve.server.protocol import ErrorResponse

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

MAX_LIST_LIMIT = 100  # OpenAI's bound on a list page


_WHEN = {
    400: "Invalid request: a field fails validation, an unknown input file, a batch that "
    "cannot be cancelled, --max-batch-file-lines, or the Batch API is off (--ray)",
    404: "No such file or batch",
    413: "The file is larger than --max-batch-file-bytes",
    429: "The server has --max-batch-jobs unfinished batch jobs",
    500: "An internal error (e.g. the disk under --batch-dir)",
    503: "The server is shutting down",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _WHEN[s]} for s in (*statuses, 500, 503)}


class BatchCreateRequest(BaseModel):
    """OpenAI's ``POST /v1/batches`` body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


# POST /v1/files is multipart, parsed by the stdlib (FastAPI's File/Form need python-multipart)
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}
_CONTENT = {200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                       "format": "binary"}}},
                  "description": "the file's bytes, as uploaded or written"}}  # fmt: skip


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

    @app.post("/v1/batches", responses=_errors(400, 429))
    async def create_batch(req: BatchCreateRequest) -> JSONResponse:
        return JSONResponse(service.create(req.model_dump()))

    @app.get("/v1/batches", responses=_errors(400, 404))
    async def list_batches(
        limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT), after: str | None = None
    ) -> JSONResponse:
        return JSONResponse(service.list(limit, after))

    @app.get("/v1/batches/{batch_id}", responses=_errors(404))
    async def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(service.get(batch_id).to_openai())

    @app.post("/v1/batches/{batch_id}/cancel", responses=_errors(400, 404))
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(service.cancel(batch_id))


def _add_file_routes(app: FastAPI, state: ServerState) -> None:
    service = state.batches

    @app.post("/v1/files", responses=_errors(400, 413), openapi_extra=_UPLOAD_BODY)
    async def upload_file(raw: Request) -> JSONResponse:
        upload = parse_multipart(raw.headers.get("content-type", ""), await raw.body())
        filename, data, purpose = check_upload(upload, service.limits)
        # off the event loop: a large file's write and fsync take a while
        obj = await asyncio.to_thread(service.files.create, data, filename, purpose)
        return JSONResponse(obj)

    @app.get("/v1/files", responses=_errors(400))
    async def list_files(purpose: str | None = None) -> JSONResponse:
        files = service.files.list(purpose)
        return JSONResponse({"object": "list", "data": files, "has_more": False})

    @app.get("/v1/files/{file_id}", responses=_errors(404))
    async def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(service.files.get(file_id))

    @app.get("/v1/files/{file_id}/content", response_class=Response,
             responses={**_CONTENT, **_errors(404)})  # fmt: skip
    async def file_content(file_id: str) -> Response:
        data = await asyncio.to_thread(service.files.content, file_id)
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", responses=_errors(400, 404))
    async def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(service.delete_file(file_id))
