"""The OpenAPI document served at ``/openapi.json``, stating the statuses the server answers.

FastAPI documents a 422 for every route with a body or a path parameter, but validation errors
are answered with OpenAI's 400 (``errors.install_error_handlers``): the 422s are dropped and
each route lists its real error statuses with the ``ErrorResponse`` body. The API key is
documented as a bearer scheme or an ``x-api-key`` header (plus a 401) on the routes the guard
middleware protects. The ``/v1/messages`` routes document Anthropic's error body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from kvserve.server.anthropic.errors import is_anthropic_path
from kvserve.server.openapi_limits import (
    PublishedLimits,
    assistant_only_tool_calls,
    json_schema_needs_its_schema,
    publish_limits,
)
from kvserve.server.protocol import ErrorResponse

_WHEN = {
    400: "Invalid request: a field fails validation, text that is not Unicode, or a limit "
    "(context length, --max-tokens-limit, --max-n, --max-prompts-per-request...)",
    401: "Missing or wrong API key",
    408: "The request's line and headers took longer than --header-read-timeout, or its body "
    "longer than --body-read-timeout (answered by the HTTP layer, which closes the connection)",
    431: "The request's line and headers are larger than --max-header-bytes, or more than "
    "--max-header-count headers (answered by the HTTP layer, which closes the connection)",
    403: "Loading and unloading LoRA adapters at run time is off "
    "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or --allow-runtime-lora-updating turns it on)",
    404: "The model (or LoRA adapter) is not served",
    409: "The model has requests in flight and cannot sleep (POST /sleep)",
    413: "The body is larger than --max-request-body-bytes",
    429: "The model's queue is full (--max-queued-requests, --max-num-queued-tokens); "
    "retry after the Retry-After header's seconds",
    500: "The engine failed while running the request (it keeps serving others)",
    503: "The server is loading its models or shutting down, the engine is dead, or the "
    "model sleeps (POST /wake_up)",
}
_SECURITY_SCHEME = "bearerAuth"
_API_KEY_SCHEME = "apiKeyHeader"


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for these error statuses, all with the OpenAI error body (or
    ``model``: Anthropic's on /v1/messages)."""
    return {s: {"model": model, "description": _WHEN[s]} for s in statuses}


def generation_responses(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: ``body`` as JSON, or SSE with ``stream: true``."""
    # Before OpenAPI 3.2 (FastAPI writes 3.1) an event stream's schema describes one event.
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": "a chunk as JSON, an {'error': ...} object, or [DONE] (the last)",
            },
            "event": {"type": "string"},
        },
    }
    sse = {"schema": event, "example": "data: {...}\n\ndata: [DONE]\n\n"}
    return {
        200: {
            "model": body,
            "description": "The response; with stream: true, server-sent events of chunks "
            "ending with 'data: [DONE]'",
            "content": {"text/event-stream": sse},
        },
        **error_responses(400, 404, 413, 429, 500, 503),
    }


def install_openapi(
    app: FastAPI, protected_prefixes: tuple[str, ...] | None, limits: PublishedLimits
) -> None:
    """Post-process FastAPI's generated document (FastAPI's documented way to extend it).

    ``protected_prefixes``: the paths that need the API key, or None when there is no key.
    ``limits``: this server's, stated in the request schemas (``openapi_limits.py``).
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # cached by FastAPI in app.openapi_schema, edited in place
            _drop_422(schema)
            _integer_bounds(schema)
            publish_limits(schema, limits)
            assistant_only_tool_calls(schema)
            json_schema_needs_its_schema(schema)
            _add_http_layer_errors(schema)
            if protected_prefixes is not None:
                _add_auth(schema, protected_prefixes)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _operations(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(path, op) for path, item in schema["paths"].items() for op in item.values()]


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# An ``int`` with a validator in front (protocol.Int) gets its Field bounds as pydantic's
# names (``{"ge": 1}``), which JSON Schema ignores: they are written as JSON Schema's.
_CONSTRAINTS = {
    "ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum",
}  # fmt: skip


def _integer_bounds(node: Any) -> None:
    """Integer fields' bounds, by JSON Schema's names, as integers. FastAPI's OpenAPI models
    hold every bound as a float, so ``ge=0`` is published as ``0.0``; and a bound near 2**63
    must be exact."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for constraint, key in _CONSTRAINTS.items():
            if constraint in node:  # a bound pydantic left by its name (see _CONSTRAINTS)
                node[key] = node.pop(constraint)
        for key in _BOUNDS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
    for value in node.values():
        _integer_bounds(value)


def _add_http_layer_errors(schema: dict[str, Any]) -> None:
    """408 and 431, which ``http_guard.py`` answers on any route before the app sees it."""
    for path, op in _operations(schema):
        # /v1/messages answers in Anthropic's error shape (anthropic/errors.py)
        body = "AnthropicErrorResponse" if is_anthropic_path(path) else "ErrorResponse"
        ref = {"$ref": f"#/components/schemas/{body}"}
        responses = op.setdefault("responses", {})
        for status in (408, 431):
            responses.setdefault(
                str(status),
                {"description": _WHEN[status], "content": {"application/json": {"schema": ref}}},
            )


def _drop_422(schema: dict[str, Any]) -> None:
    for _, op in _operations(schema):
        op.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _add_auth(schema: dict[str, Any], prefixes: tuple[str, ...]) -> None:
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[_SECURITY_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's --api-key",
    }
    schemes[_API_KEY_SCHEME] = {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "the server's --api-key, as Anthropic's clients send it",
    }
    for path, op in _operations(schema):
        if path.startswith(prefixes):
            op["security"] = [{_SECURITY_SCHEME: []}, {_API_KEY_SCHEME: []}]  # either one
            # /v1/messages answers in Anthropic's error shape (anthropic/errors.py)
            body = "AnthropicErrorResponse" if is_anthropic_path(path) else "ErrorResponse"
            op.setdefault("responses", {})["401"] = {
                "description": _WHEN[401],
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}
                },
            }
