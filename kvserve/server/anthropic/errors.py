"""Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

Every error answered on a ``/v1/messages`` route takes this shape, whoever raises it (the
route, the request validation, the API-key and body-size guard): ``kvserve/server/errors.py``
picks the shape by the route's path. The official ``anthropic`` client picks its exception
class from the status (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413
RequestTooLargeError, 429 RateLimitError, 503 / 529 overloaded) and reads ``error.type``.
"""

from __future__ import annotations

import json

ANTHROPIC_PREFIX = "/v1/messages"

# status -> Anthropic's error type (its documented list; 503 is kvserve's "overloaded")
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_json(status: int, message: str) -> str:
    """The body, as ASCII-only JSON (a message may quote client text, lone surrogates too)."""
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return json.dumps(body, ensure_ascii=True, separators=(",", ":"))


def error_event(status: int, message: str) -> str:
    """An error inside a stream whose status line is already sent (Anthropic's ``error``)."""
    return f"event: error\ndata: {error_json(status, message)}\n\n"
