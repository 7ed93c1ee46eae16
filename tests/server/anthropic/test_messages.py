"""/v1/messages and /v1/messages/count_tokens through the official ``anthropic`` client,
against the shared ``kvserve serve`` (built-in model, behind an API key)."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY, BUILTIN, Server

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant."
USER = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
WEATHER_CHOICE = {"type": "tool", "name": "get_weather"}


def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def tokenize(server: Server, body: dict[str, Any]) -> int:
    r = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def prompt_tokens(message: anthropic.types.Message) -> int:
    """All the prompt's tokens: Anthropic counts cache reads apart from input_tokens."""
    u = message.usage
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def summary(m: anthropic.types.Message) -> dict[str, Any]:
    """What a streamed and a unary answer must share (ids are random each time)."""
    blocks = [b.model_dump(exclude={"id", "citations"}) for b in m.content]
    return {
        "content": blocks, "stop_reason": m.stop_reason, "stop_sequence": m.stop_sequence,
        "output_tokens": m.usage.output_tokens, "prompt_tokens": prompt_tokens(m),
        "model": m.model, "role": m.role, "type": m.type,
    }  # fmt: skip


MESSAGE_ID = re.compile(r"msg_01[0-9A-Za-z]{22}")
TOOL_USE_ID = re.compile(r"toolu_01[0-9A-Za-z]{22}")


def check_ids(m: anthropic.types.Message) -> None:
    """Anthropic's id shapes: ``msg_01...`` for the message, ``toolu_01...`` per tool use."""
    assert MESSAGE_ID.fullmatch(m.id), m.id
    tool_ids = [b.id for b in m.content if b.type == "tool_use"]
    assert all(TOOL_USE_ID.fullmatch(i) for i in tool_ids), tool_ids
    assert len(set(tool_ids)) == len(tool_ids)


def unary_and_streamed(server: Server, **kw: Any) -> anthropic.types.Message:
    """The unary answer, after checking that the streamed one (greedy) is the same."""
    c = client(server)
    greedy = {"temperature": 0}  # the SDK no longer has temperature (Anthropic's models fix it)
    unary = c.messages.create(model=BUILTIN, extra_body=greedy, **kw)
    with c.messages.stream(model=BUILTIN, extra_body=greedy, **kw) as s:
        streamed = s.get_final_message()
    assert summary(streamed) == summary(unary)
    check_ids(unary)
    check_ids(streamed)
    assert unary.id != streamed.id
    return unary


def test_create_plain(server: Server) -> None:
    m = unary_and_streamed(server, max_tokens=8, system=SYSTEM, messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.model == BUILTIN
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 8
    chat = [{"role": "system", "content": SYSTEM}, *USER]
    assert prompt_tokens(m) == tokenize(server, {"messages": chat})


def test_stream_events(server: Server) -> None:
    body = {"model": BUILTIN, "max_tokens": 4, "messages": USER, "stream": True}
    headers = {"x-api-key": API_KEY}
    url = f"{server.url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e.split("\n") for e in text.strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[2]["content_block"] == {"type": "text", "text": ""}
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in datas[3:-3])
    delta = datas[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] <= 4


def test_stop_sequences(server: Server) -> None:
    kw: dict[str, Any] = {"max_tokens": 24, "system": SYSTEM, "messages": USER}
    free = client(server).messages.create(model=BUILTIN, extra_body={"temperature": 0}, **kw)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    m = unary_and_streamed(server, stop_sequences=["\u2603never", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_tool_use_round_trip(server: Server) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = unary_and_streamed(
        server, max_tokens=64, messages=ask, tools=[WEATHER], tool_choice=WEATHER_CHOICE
    )
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    result = "18 degrees and sunny"
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": result},
        ]},
    ]  # fmt: skip
    kw: dict[str, Any] = {"messages": turn, "tools": [WEATHER], "tool_choice": {"type": "none"}}
    answer = unary_and_streamed(server, max_tokens=8, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)
    # the tool result reached the prompt: the chat request that means the same has as many
    # tokens (and a different result, different ones)
    chat = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]  # fmt: skip
    function = {"name": WEATHER["name"], "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}  # fmt: skip
    tools = [{"type": "function", "function": function}]
    assert prompt_tokens(answer) == tokenize(server, {"messages": chat, "tools": tools})
    counted = client(server).messages.count_tokens(model=BUILTIN, **kw)
    assert counted.input_tokens == prompt_tokens(answer)


def test_count_tokens(server: Server) -> None:
    c = client(server)
    counted = c.messages.count_tokens(model=BUILTIN, system=SYSTEM, messages=USER)
    chat = [{"role": "system", "content": SYSTEM}, *USER]
    assert counted.input_tokens == tokenize(server, {"messages": chat})
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]
    system = [{"type": "text", "text": SYSTEM}]
    assert c.messages.count_tokens(model=BUILTIN, system=system, messages=blocks).input_tokens == (
        counted.input_tokens
    )


def test_prefill_continues_the_assistant_message(server: Server) -> None:
    prefill = [*USER, {"role": "assistant", "content": "Red, green and"}]
    m = unary_and_streamed(server, max_tokens=4, messages=prefill)
    chat = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    assert prompt_tokens(m) == tokenize(server, chat)


def test_x_api_key_and_bearer(server: Server) -> None:
    body = {"model": BUILTIN, "max_tokens": 1, "messages": USER}
    url = f"{server.url}/v1/messages"
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": API_KEY, "X-Api-Key": API_KEY}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=BUILTIN, max_tokens=1, messages=USER
        )
    # the OpenAI routes take x-api-key too (one key, two spellings)
    models = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": API_KEY}, timeout=10)
    assert models.status_code == 200


def _with(**kw: Any) -> dict[str, Any]:
    return {"model": BUILTIN, "max_tokens": 4, "messages": USER, **kw}


def _user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
            "data": "x"}}  # fmt: skip
BAD: list[tuple[str, dict[str, Any] | str, int, str, str]] = [
    # (case, body, status, Anthropic error type, a part of the message)
    ("no max_tokens", {"model": BUILTIN, "messages": USER}, 400, "invalid_request_error",
     "max_tokens"),
    ("max_tokens 0", _with(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    ("temperature 1.5", _with(temperature=1.5), 400, "invalid_request_error", "temperature"),
    ("no messages", _with(messages=[]), 400, "invalid_request_error", "messages"),
    ("image", _with(messages=_user(IMAGE)), 400, "invalid_request_error", "'image'"),
    ("document", _with(messages=_user(DOCUMENT)), 400, "invalid_request_error", "'document'"),
    ("tool_use from the user", _with(messages=_user(
        {"type": "tool_use", "id": "t", "name": "f", "input": {}})), 400,
     "invalid_request_error", "'tool_use'"),
    ("web search", _with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "web_search_20250305"),
    ("mcp", _with(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), 400,
     "invalid_request_error", "mcp_servers"),
    ("tool_choice without a name", _with(tools=[WEATHER], tool_choice={"type": "tool"}), 400,
     "invalid_request_error", "name"),
    ("tool_choice unknown tool", _with(tools=[WEATHER], tool_choice={"type": "tool",
     "name": "nope"}), 400, "invalid_request_error", "tool_choice"),
    ("auto without a parser", _with(tools=[WEATHER]), 400, "invalid_request_error",
     "--enable-auto-tool-choice"),
    ("unknown model", _with(model="claude-nope"), 404, "not_found_error", "claude-nope"),
    ("over --max-tokens-limit", _with(max_tokens=5000), 400, "invalid_request_error",
     "--max-tokens-limit"),
    ("not JSON", "{", 400, "invalid_request_error", "JSON"),
    ("too large", _with(system="x" * 70000), 413, "request_too_large", "--max-request-body"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "status", "kind", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_anthropic_errors(
    server: Server, case: str, body: dict[str, Any] | str, status: int, kind: str, says: str
) -> None:
    headers = {"x-api-key": API_KEY, "content-type": "application/json"}
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/messages", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert says in error["error"]["message"], error
    # the server goes on serving
    ok = client(server).messages.create(model=BUILTIN, max_tokens=1, messages=USER)
    assert ok.usage.output_tokens == 1


def test_sdk_exceptions_and_unknown_routes(server: Server) -> None:
    with pytest.raises(anthropic.BadRequestError, match="'image'"):
        client(server).messages.create(model=BUILTIN, max_tokens=1, messages=_user(IMAGE))
    with pytest.raises(anthropic.NotFoundError):
        client(server).messages.create(model="nope", max_tokens=1, messages=USER)
    url, headers = f"{server.url}/v1/messages/nope", {"x-api-key": API_KEY}
    r = httpx.post(url, json={}, headers=headers, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
