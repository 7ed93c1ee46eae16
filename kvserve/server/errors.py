"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The official ``openai`` client picks its exception class from the status code
(400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError...) and
reads ``type``/``param``/``code`` from the body, so every error path goes through here.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from kvserve.server.anthropic.errors import error_json as anthropic_error_json
from kvserve.server.anthropic.errors import is_anthropic_path
from kvserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvserve.server")

# (status -> default OpenAI error type); OpenAI uses "invalid_request_error" for most 4xx.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # the OpenAI field name
        param: str | None = None,
        code: int | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers

    def response(self, path: str = "") -> Response:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code,
            headers=self.headers, path=path,
        )  # fmt: skip


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: int | str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> Response:
    """The error in the shape of the API that ``path`` (the request's route) belongs to:
    Anthropic's on ``/v1/messages``, OpenAI's everywhere else."""
    if is_anthropic_path(path):
        content = anthropic_error_json(status, message)
        return Response(content, status_code=status, headers=headers, media_type="application/json")
    body = ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=type or _TYPES.get(status, "invalid_request_error"),
            param=param,
            code=code if code is not None else status,
        )
    )
    return Response(
        _ascii_json(body), status_code=status, headers=headers, media_type="application/json"
    )


def _ascii_json(body: ErrorResponse) -> str:
    """The body as ASCII-only JSON: a message may quote client text, and text holding a lone
    surrogate cannot be encoded as UTF-8 (JSONResponse would raise while answering an error);
    ``\\u`` escapes can carry anything."""
    return json.dumps(body.model_dump(), ensure_ascii=True, separators=(",", ":"))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_event(error: APIError) -> str:
    """An error inside an SSE stream (the status line has already been sent), as vLLM does."""
    body = ErrorResponse(
        error=ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    )
    return f"data: {_ascii_json(body)}\n\n"


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending field from pydantic's error list (FastAPI's
    body errors, or a model validated directly, as the gRPC API does)."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc is ("body", character offset): no field
            at = (err.get("loc") or ("?",))[-1]
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON: {detail} (at character {at})")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for our errors, validation (400, not 422), routing and crashes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc)
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        path = request.url.path
        return error_response(exc.status_code, str(exc.detail), headers=headers, path=path)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in a request handler")
        message = f"internal server error: {type(exc).__name__}"
        return error_response(500, message, path=request.url.path)
