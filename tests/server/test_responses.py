"""``/v1/responses`` with the official openai client against a live ``kvserve serve``.

Greedy decoding makes every answer exact: a streamed answer equals the unary one, and a
Responses answer equals the chat completion of the conversation it translates into. Input
token counts are checked against ``/tokenize`` of the expected conversation, so that
``previous_response_id`` and ``function_call_output`` are shown to build exactly that prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import BUILTIN, TINY, Server, start_server

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": WEATHER,
    },
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
GREEDY: dict[str, Any] = {"model": BUILTIN, "temperature": 0}


def client(server: Server) -> openai.OpenAI:
    return server.client(timeout=TIMEOUT, max_retries=0)


def prompt_tokens(server: Server, messages: list[dict[str, Any]], **kw: Any) -> int:
    r = httpx.post(
        f"{server.url}/tokenize",
        headers=server.headers(),
        timeout=TIMEOUT,
        json={"model": BUILTIN, "messages": messages, **kw},
    )
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def chat_text(server: Server, messages: list[dict[str, Any]], max_tokens: int) -> str | None:
    r = client(server).chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)  # type: ignore[arg-type]
    return r.choices[0].message.content


def test_plain_is_the_chat_answer_with_usage(server: Server) -> None:
    r = client(server).responses.create(
        input="Name a colour.", instructions="Answer in one word.", max_output_tokens=6, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == BUILTIN
    assert r.output_text == chat_text(server, messages, 6)
    assert r.output_text  # the model says something
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage is not None
    assert r.usage.input_tokens == prompt_tokens(server, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.instructions, r.temperature, r.top_p, r.store) == ("Answer in one word.", 0, 1, True)


def test_max_output_tokens_makes_it_incomplete(server: Server) -> None:
    r = client(server).responses.create(
        input="Tell me a long story.", max_output_tokens=3, **GREEDY
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The response less its ids, time and prefix-cache hits (the second run hits more)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created_at")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "input_tokens_details"}
    out["output"] = [
        {k: v for k, v in i.items() if k not in ("id", "call_id")} for i in body["output"]
    ]
    return out


def test_streamed_text_events_in_order_equal_the_unary_answer(server: Server) -> None:
    kw = {"input": "Say hello to Ana.", "max_output_tokens": 10, **GREEDY}
    unary = client(server).responses.create(**kw)
    events = list(client(server).responses.create(stream=True, **kw))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    last = "response.incomplete" if unary.status == "incomplete" else "response.completed"
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert len(deltas) >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created = events[0].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.output == []
    item_id = events[2].item.id  # type: ignore[union-attr]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert text == unary.output_text == events[-4].text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output[0].id == item_id
    assert _without_ids(final.model_dump()) == _without_ids(unary.model_dump())
    # a streamed response is stored once it finishes, as the last event has it
    assert client(server).responses.retrieve(final.id).model_dump() == final.model_dump()


def test_stream_helper_gets_the_final_response(server: Server) -> None:
    # max_output_tokens 1: "completed" only when the answer ends by itself, so ask for room
    with client(server).responses.stream(
        input="Reply with OK.", max_output_tokens=64, **GREEDY
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text


def _call(server: Server, **kw: Any) -> Any:
    r = client(server).responses.create(
        input="What is the weather in Paris?", tools=TOOLS, **GREEDY, **kw
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert [(t.name, t.parameters) for t in r.tools] == [("get_weather", WEATHER)]  # type: ignore[union-attr]
    return r


def test_function_call_round_trip_through_function_call_output(server: Server) -> None:
    first = _call(server, tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[0]
    assert call.status == "completed" and call.id.startswith("fc_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    items = [question, call.model_dump(exclude_none=True), result]
    second = client(server).responses.create(
        input=items, tools=TOOLS, tool_choice="none", max_output_tokens=8, **GREEDY
    )
    chained = client(server).responses.create(
        input=[result],
        previous_response_id=first.id,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        **GREEDY,
    )
    messages = [
        question,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    expected = prompt_tokens(server, messages, tools=CHAT_TOOLS)
    assert second.usage is not None and chained.usage is not None
    assert second.usage.input_tokens == chained.usage.input_tokens == expected
    assert second.output_text == chained.output_text


def test_streamed_function_call_equals_the_unary_one(server: Server) -> None:
    unary = _call(server, tool_choice="required")
    events = list(
        client(server).responses.create(
            input="What is the weather in Paris?",
            tools=TOOLS,
            tool_choice="required",
            stream=True,
            **GREEDY,
        )
    )
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(e.delta for e in deltas)
    assert arguments == events[-3].arguments == unary.output[0].arguments  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert _without_ids(final.model_dump()) == _without_ids(unary.model_dump())


def test_previous_response_id_continues_the_conversation(server: Server) -> None:
    c = client(server)
    first = c.responses.create(
        input="My name is Ana.", instructions="Be brief.", max_output_tokens=8, **GREEDY
    )
    second = c.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    third = c.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Again?"}]}],
        previous_response_id=second.id,
        max_output_tokens=4,
        **GREEDY,
    )
    # instructions are not carried over (OpenAI's rule); each turn's output is
    turns = [
        {"role": "user", "content": "My name is Ana."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage is not None and third.usage is not None
    assert second.usage.input_tokens == prompt_tokens(server, turns)
    assert second.output_text == chat_text(server, turns, 6)
    turns += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Again?"},
    ]
    assert third.usage.input_tokens == prompt_tokens(server, turns)
    assert third.output_text == chat_text(server, turns, 4)


def test_get_and_delete(server: Server) -> None:
    c = client(server)
    r = c.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    url, headers = f"{server.url}/v1/responses/{r.id}", server.headers()
    gone = httpx.delete(url, headers=headers, timeout=TIMEOUT)
    assert (gone.status_code, gone.json()) == (
        200,
        {"id": r.id, "object": "response.deleted", "deleted": True},
    )
    for again in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            again()
    unstored = c.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="not found") as e:
        c.responses.create(input="Hi", previous_response_id=unstored.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_text_format_json_schema_and_json_object(server: Server) -> None:
    c = client(server)
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    r = c.responses.create(input="The weather in Oslo as JSON.", text={"format": fmt}, **GREEDY)  # type: ignore[arg-type]
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"
    r = c.responses.create(
        input="A JSON object, please.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=64,
        **GREEDY,
    )
    if r.status == "completed":  # a cut object is not JSON yet
        assert isinstance(json.loads(r.output_text), dict)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    (
        {
            "tools": [
                {
                    "type": "computer_use_preview",
                    "display_width": 8,
                    "display_height": 8,
                    "environment": "linux",
                }
            ]
        },
        "tools",
    ),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
]


def test_every_unsupported_or_bad_field_is_a_400_and_the_next_request_is_served(
    server: Server,
) -> None:
    for fields, param in BAD:
        body = {"model": TINY, "input": "hi", "max_output_tokens": 2, **fields}
        r = httpx.post(
            f"{server.url}/v1/responses", json=body, headers=server.headers(), timeout=TIMEOUT
        )
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), (fields, error)
    ok = client(server).responses.create(model=TINY, input="hi", max_output_tokens=2)
    assert ok.usage is not None and ok.usage.output_tokens == 2


@pytest.fixture(scope="module")
def small_store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "responses_store_server.log"
    srv = start_server(
        [
            str(tiny_model_dir),
            "--served-model-name",
            TINY,
            "--num-kv-blocks",
            "64",
            "--responses-store-max-entries",
            "2",
        ],
        log,
    )
    yield srv
    srv.stop()


def test_the_store_evicts_the_oldest_past_its_count(small_store: Server) -> None:
    c = client(small_store)
    ids = [
        c.responses.create(model=TINY, input=f"turn {i}", max_output_tokens=1).id for i in range(3)
    ]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    with pytest.raises(openai.BadRequestError, match="not found"):
        c.responses.create(model=TINY, input="next", previous_response_id=ids[0])
    c.responses.create(model=TINY, input="next", previous_response_id=ids[1], max_output_tokens=1)
    # ids[1] was the oldest kept: the chained turn evicted it
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[1])
    assert c.responses.retrieve(ids[2]).id == ids[2]
