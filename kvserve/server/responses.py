"""``POST /v1/responses`` and ``GET`` / ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A translation at both ends of the chat pipeline and nothing else: the request becomes a
``ChatCompletionRequest`` (``responses_protocol.to_chat_request``, after the stored
conversation of ``previous_response_id``), ``chat_pipeline.start_chat`` admits it exactly as
``/v1/chat/completions`` admits its own (limits, tools, template off the event loop, grammar,
submit), and ``responses_output.OutputBuilder`` turns the engine's outputs into output items
and stream events. Answers with ``store`` (true unless the request says false) are kept in the
server's ``ResponseStore`` (``responses_store.py``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.chat_pipeline import ChatRun, start_chat
from kvserve.server.errors import APIError, bad_request
from kvserve.server.openapi import error_responses, generation_responses
from kvserve.server.protocol import ChatMessage
from kvserve.server.responses_output import OutputBuilder, assistant_messages
from kvserve.server.responses_protocol import (
    RESPONSES_PARAM,
    ResponsesRequest,
    input_messages,
    to_chat_request,
    unsupported_fields,
)
from kvserve.server.responses_store import ResponseStore, StoredResponse
from kvserve.server.serving import (
    final_outputs,
    merge_streams,
    new_id,
    run_watching_disconnect,
    stream_error,
    to_json,
    usage_info,
)

if TYPE_CHECKING:
    from kvserve.server.app import ServerState


class ResponseObject(BaseModel):
    """The response object (documented loosely: its items are OpenAI's, as plain JSON)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


@dataclass(frozen=True)
class _Turn:
    """What answering one request needs besides the engine's outputs."""

    response_id: str
    created_at: int
    req: ResponsesRequest
    model: str
    params: SamplingParams
    run: ChatRun
    store: bool  # kept in the store once finished
    conversation: tuple[dict[str, Any], ...]  # stored history + this request's input


def _history(req: ResponsesRequest, store: ResponseStore) -> list[ChatMessage]:
    if req.previous_response_id is None:
        return []
    if store.limits.off_reason is not None:
        raise bad_request(
            f"previous_response_id cannot be used: {store.limits.off_reason}",
            "previous_response_id",
        )
    entry = store.get(req.previous_response_id)
    if entry is None:
        raise bad_request(
            f"Previous response with id '{req.previous_response_id}' not found (never stored, "
            "deleted, past --responses-store-ttl or evicted by the store's bounds)",
            "previous_response_id",
        )
    return [ChatMessage.model_validate(m) for m in entry.conversation]


async def create_response(
    req: ResponsesRequest, raw: Request, engine: AsyncLLMEngine, state: ServerState
) -> Response:
    unsupported_fields(req)
    store = state.responses
    history = _history(req, store)
    new = input_messages(req.input)
    chat = to_chat_request(req, history, new)
    try:
        run = await start_chat(chat, raw, engine, state.limits, state.chat_options, new_id("resp"))
    except APIError as e:  # name the Responses field, not the chat one it became
        e.param = RESPONSES_PARAM.get(e.param or "", e.param)
        raise
    conversation = [m.model_dump(mode="json", exclude_none=True) for m in [*history, *new]]
    turn = _Turn(
        response_id=run.request_id.replace("resp-", "resp_", 1),
        created_at=int(time.time()),
        req=req,
        model=engine.model_name,
        params=run.params,
        run=run,
        store=req.stores and store.enabled,
        conversation=tuple(conversation),
    )
    if req.stream:
        return StreamingResponse(_stream(turn, store), media_type="text/event-stream")
    (out,) = await run_watching_disconnect(raw, final_outputs(run.streams))
    builder = OutputBuilder(run.plan.tools, run.plan.reasoning)
    (c,) = out.outputs
    builder.step(c.text, c.finish_reason or "stop", c.token_ids)
    body = _finish(turn, store, builder, out)
    return Response(to_json(body), media_type="application/json")


def _finish(
    turn: _Turn, store: ResponseStore, builder: OutputBuilder, out: RequestOutput
) -> dict[str, Any]:
    """The finished response object; kept in the store when the turn stores."""
    status = "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
    output = builder.output(status)
    body = _response(turn, status, output, _usage(out))
    if turn.store:
        conversation = (*turn.conversation, *assistant_messages(output))
        text = to_json(body)
        size = len(text.encode()) + len(to_json(list(conversation)).encode())
        if store.put(turn.response_id, StoredResponse(text, conversation, size)):
            return body
        body["store"] = False  # alone larger than --responses-store-max-bytes: not kept
    return body


def _usage(out: RequestOutput) -> dict[str, Any]:
    u = usage_info([out])
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},  # SEAM(reasoning): count them
        "total_tokens": u.total_tokens,
    }


def _response(
    turn: _Turn, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    req, plan = turn.req, turn.run.plan.tools
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    tool_choice: Any = plan.mode
    if plan.mode == "named":
        tool_choice = {"type": "function", "name": plan.function_name}
    # the request's function tools (all function tools: others were refused), as given
    keys = ("name", "description", "parameters", "strict")
    tools = [{"type": "function", **t.model_dump(include=set(keys))} for t in req.tools or ()]
    return {
        "id": turn.response_id,
        "object": "response",
        "created_at": turn.created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "model": turn.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": turn.store,
        "temperature": turn.params.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": turn.params.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
    }


async def _stream(turn: _Turn, store: ResponseStore) -> AsyncIterator[str]:
    """The response's events (``responses_output``); an engine failure is an ``error`` event."""
    builder = OutputBuilder(turn.run.plan.tools, turn.run.plan.reasoning)
    started = _response(turn, "in_progress", [], None)
    yield builder.event("response.created", response=started)
    yield builder.event("response.in_progress", response=started)
    merged = merge_streams(turn.run.streams)
    try:
        async for _, out in merged:
            (c,) = out.outputs
            for event in builder.step(c.text, c.finish_reason, c.token_ids):
                yield event
            if out.finished:
                body = _finish(turn, store, builder, out)
                done = "incomplete" if body["status"] == "incomplete" else "completed"
                yield builder.event(f"response.{done}", response=body)
    except Exception as e:
        err = stream_error(e)
        yield builder.event("error", code=str(err.code), message=err.message, param=err.param)
    finally:
        await merged.aclose()


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    reason = store.limits.off_reason
    if reason is not None:
        raise bad_request(f"stored responses cannot be read: {reason}", "response_id")
    entry = store.get(response_id)
    if entry is None:
        raise APIError(
            404,
            f"Response with id '{response_id}' not found.",
            param="response_id",
            code="not_found",
        )
    return entry


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/responses`` routes (registered by ``app.build_app``)."""

    @app.post("/v1/responses", responses=generation_responses(ResponseObject))
    async def create(req: ResponsesRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_response(req, raw, engine, state)

    read = {200: {"model": ResponseObject}, **error_responses(400, 404, 500, 503)}

    @app.get("/v1/responses/{response_id}", responses=read)  # type: ignore[arg-type]
    async def retrieve(
        response_id: str,
        # published as false only: the document must not promise what is refused
        stream: bool = Query(False, json_schema_extra={"enum": [False]}),
    ) -> Response:
        if stream:
            raise bad_request("streaming a stored response is not supported", "stream")
        entry = _stored(state.responses, response_id)
        return Response(entry.response_json, media_type="application/json")

    deleted = {200: {"model": DeletedResponse}, **error_responses(400, 404, 500, 503)}

    @app.delete("/v1/responses/{response_id}", responses=deleted)  # type: ignore[arg-type]
    async def delete(response_id: str) -> DeletedResponse:
        _stored(state.responses, response_id)
        state.responses.delete(response_id)
        return DeletedResponse(id=response_id)
