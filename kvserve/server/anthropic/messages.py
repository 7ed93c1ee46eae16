"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's request in, through
the chat pipeline (``start_chat``), Anthropic's message or event stream out.

Content blocks come from the chat pipeline's reading of the output: the reasoning parser's
thinking is a ``thinking`` block, the answer a ``text`` block, each tool call a ``tool_use``
block. A stream sends the same blocks as Anthropic's events: ``message_start``, ``ping``,
then per block ``content_block_start``, ``content_block_delta`` (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, the final usage) and ``message_stop``; an error after
the start is an ``error`` event. The stream's blocks add up to the unary message's.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.outputs import RequestOutput
from kvserve.server.anthropic.errors import error_event
from kvserve.server.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    Usage,
)
from kvserve.server.anthropic.translate import to_chat_request
from kvserve.server.chat_pipeline import (
    ChatRun,
    ChoiceDeltas,
    choice_message,
    plan_chat,
    start_chat,
)
from kvserve.server.protocol import ChatResponseMessage
from kvserve.server.serving import (
    Limits,
    final_outputs,
    merge_streams,
    run_watching_disconnect,
    stream_error,
    to_json,
)
from kvserve.server.tools import ChatOptions

# Anthropic's ids: a kind, ``_01``, then 22 base62 characters (``msg_01XFDUDYJgAACzvnptvVoYEL``,
# ``toolu_01A09q90qw90lq917835lq9``); clients (Claude Code among them) keep and echo them.
_ID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def anthropic_id(kind: str) -> str:
    """A new random id of Anthropic's shape: ``msg`` for messages, ``toolu`` for tool uses."""
    return f"{kind}_01" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(22))


def stop_reason(
    finish_reason: str | None, engine_stop: int | str | None, called_tools: bool
) -> tuple[str, str | None]:
    """Anthropic's (``stop_reason``, ``stop_sequence``) for a finished choice."""
    if finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(engine_stop, str):  # the stop string that matched (vLLM's stop_reason)
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(out: RequestOutput) -> Usage:
    cached = out.num_cached_tokens
    return Usage(
        input_tokens=len(out.prompt_token_ids) - cached,
        output_tokens=sum(len(c.token_ids) for c in out.outputs),
        cache_read_input_tokens=cached,
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``input``; a call cut by max_tokens has none that parse: {}."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: ChatResponseMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or ():
        blocks.append(
            {
                "type": "tool_use",
                "id": anthropic_id("toolu"),  # the chat side's call id is OpenAI-shaped
                "name": call.function.name,
                "input": tool_input(call.function.arguments),
            }
        )
    return blocks


async def create_message(
    req: MessagesRequest,
    raw: Request,
    engine: AsyncLLMEngine,
    limits: Limits,
    options: ChatOptions,
) -> Response:
    chat = to_chat_request(req, options.reasoning_parser is not None)
    run = await start_chat(chat, raw, engine, limits, options, anthropic_id("msg"))
    if req.stream:
        return StreamingResponse(_stream(run, engine), media_type="text/event-stream")
    (out,) = await run_watching_disconnect(raw, final_outputs(run.streams))
    c = out.outputs[0]
    message, finish = choice_message(run.plan, c.text, c.finish_reason, c.token_ids)
    reason, sequence = stop_reason(finish, c.stop_reason, bool(message.tool_calls))
    body = MessageResponse(
        id=run.request_id,
        model=engine.model_name,
        content=content_blocks(message),
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage(out),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def count_tokens(
    req: CountTokensRequest, engine: AsyncLLMEngine, limits: Limits, options: ChatOptions
) -> CountTokensResponse:
    """The prompt tokens ``/v1/messages`` would give the engine (the same checks first)."""
    chat = to_chat_request(req, options.reasoning_parser is not None)
    plan = await plan_chat(chat, engine, limits, options)
    return CountTokensResponse(input_tokens=len(plan.prompt.token_ids))


def event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {to_json(data)}\n\n"


class BlockEvents:
    """The content-block events of one streamed message, from its chat deltas: a block
    opens when a new kind of delta comes (thinking, text, a new tool call) and closes when
    the next one opens or the message ends."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # (kind, tool call index) of the open block
        self.called_tools = False

    def _switch(self, key: tuple[str, int], block: dict[str, Any]) -> list[str]:
        if self.open == key:
            return []
        events = self.close()
        self.index += 1
        self.open = key
        events.append(event({"type": "content_block_start", "index": self.index,
                             "content_block": block}))  # fmt: skip
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if thinking := delta.get("reasoning"):
            block = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._switch(("thinking", 0), block)
            events.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
        if text := delta.get("content"):
            events += self._switch(("text", 0), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:  # a call's first delta: id, name, arguments so far
                self.called_tools = True
                block = {"type": "tool_use", "id": anthropic_id("toolu"),
                         "name": function.get("name"), "input": {}}  # fmt: skip
                events += self._switch(("tool_use", call["index"]), block)
            if arguments := function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.index})]


async def _stream(run: ChatRun, engine: AsyncLLMEngine) -> AsyncIterator[str]:
    num_prompt = len(run.plan.prompt.token_ids)
    start = {
        "id": run.request_id, "type": "message", "role": "assistant", "model": engine.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": num_prompt, "output_tokens": 0},
    }  # fmt: skip
    yield event({"type": "message_start", "message": start})
    yield event({"type": "ping"})
    deltas, blocks = ChoiceDeltas(run.plan), BlockEvents()
    merged = merge_streams(run.streams)
    try:
        async for _, out in merged:
            c = out.outputs[0]
            delta, finish = deltas.step(c.text, c.finish_reason, c.token_ids)
            for e in blocks.feed(delta):
                yield e
            if not out.finished:
                continue
            for e in blocks.close():
                yield e
            reason, sequence = stop_reason(finish, c.stop_reason, blocks.called_tools)
            yield event({
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(out).model_dump(),
            })  # fmt: skip
            yield event({"type": "message_stop"})
    except Exception as e:
        error = stream_error(e)
        yield error_event(error.status, error.message)
    finally:
        await merged.aclose()
