"""The Messages API's routes, registered by ``build_app`` (``kvserve/server/app.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvserve.server.anthropic.messages import count_tokens, create_message
from kvserve.server.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from kvserve.server.anthropic.translate import check_unsupported_fields
from kvserve.server.openapi import error_responses

if TYPE_CHECKING:
    from kvserve.server.app import ServerState


async def _refuse_unsupported(raw: Request) -> None:
    """A 400 naming a field kvserve cannot honour (the model ignores unknown fields)."""
    body: Any = await raw.json()
    if isinstance(body, dict):
        check_unsupported_fields(body)


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    errors = error_responses(400, 404, 413, 429, 500, 503, model=AnthropicErrorResponse)
    # Before OpenAPI 3.2 (FastAPI writes 3.1) an event stream's schema describes one event.
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    }
    sse = {"text/event-stream": {"schema": event}}
    described = "The message; with stream: true, Anthropic's server-sent events"

    @app.post(
        "/v1/messages",
        responses={200: {"model": MessageResponse, "description": described, "content": sse},
                   **errors},
    )  # fmt: skip
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        await _refuse_unsupported(raw)
        engine = state.engine_for(req.model)
        return await create_message(req, raw, engine, state.limits, state.chat_options)

    counting = error_responses(400, 404, 413, 500, 503, model=AnthropicErrorResponse)

    @app.post("/v1/messages/count_tokens", responses=counting)
    async def messages_count_tokens(req: CountTokensRequest, raw: Request) -> CountTokensResponse:
        await _refuse_unsupported(raw)
        engine = state.engine_for(req.model)
        return await count_tokens(req, engine, state.limits, state.chat_options)
