"""The /v1/responses translations without a server: input items into chat messages, engine
text into output items and stream events (the reasoning seam included)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserve.server.errors import APIError
from kvserve.server.openapi_limits import PublishedLimits, publish_limits
from kvserve.server.protocol import ChatMessage
from kvserve.server.reasoning import get_reasoning_parser
from kvserve.server.responses_output import OutputBuilder, assistant_messages
from kvserve.server.responses_protocol import ResponsesRequest, input_messages, to_chat_request
from kvserve.server.tools import ToolPlan


def events(builder: OutputBuilder, *steps: tuple[str, str | None]) -> list[dict[str, Any]]:
    out = []
    for text, finish in steps:
        for e in builder.step(text, finish):
            head, data = e.split("\n", 1)
            body = json.loads(data.removeprefix("data: "))
            assert head == f"event: {body['type']}"
            out.append(body)
    return out


def test_text_grows_into_deltas_and_one_message() -> None:
    b = OutputBuilder(ToolPlan("none"))
    evs = events(b, ("Hel", None), ("Hello", None), ("Hello!", "length"))
    assert [e["type"] for e in evs] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in evs] == list(range(8))
    assert [e["delta"] for e in evs if "delta" in e] == ["Hel", "lo", "!"]
    (item,) = b.output("incomplete")
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hello!"
    assert evs[-1]["item"] == item


def test_an_empty_answer_is_one_empty_message() -> None:
    b = OutputBuilder(ToolPlan("none"))
    types = [e["type"] for e in events(b, ("", "stop"))]
    assert "response.output_text.delta" not in types
    assert types[0] == "response.output_item.added" and types[-1] == "response.output_item.done"
    assert b.output("completed")[0]["content"][0]["text"] == ""


def test_named_call_streams_arguments_and_becomes_a_function_call() -> None:
    plan = ToolPlan("named", function_name="f", max_calls=1, schema={"type": "object"})
    b = OutputBuilder(plan)
    evs = events(b, ('{"a"', None), ('{"a": 1}', "stop"))
    assert [e["type"] for e in evs] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]  # fmt: skip
    (item,) = b.output("completed")
    assert (item["type"], item["name"], item["arguments"]) == ("function_call", "f", '{"a": 1}')
    assert assistant_messages([item]) == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": item["call_id"],
         "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]  # fmt: skip


def test_a_reasoning_parser_puts_a_reasoning_item_first() -> None:
    b = OutputBuilder(ToolPlan("none"), get_reasoning_parser("qwen3")())
    evs = events(
        b, ("<think>Hmm", None), ("<think>Hmm.</think>Hi", None), ("<think>Hmm.</think>Hi!", "stop")
    )
    assert [e["type"] for e in evs] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    reasoning, message = b.output("completed")
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert message["content"][0]["text"] == "Hi!"


def test_input_items_become_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    got = [m.model_dump(exclude_none=True) for m in input_messages(items)]
    assert got == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
        ]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
    ]  # fmt: skip


def test_instructions_go_first_then_the_stored_history() -> None:
    req = ResponsesRequest(input="now", instructions="sys", max_output_tokens=5, temperature=0.5)
    history = [ChatMessage(role="user", content="before")]
    chat = to_chat_request(req, history, input_messages(req.input))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "sys"),
        ("user", "before"),
        ("user", "now"),
    ]
    assert (chat.max_completion_tokens, chat.temperature, chat.n) == (5, 0.5, 1)


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
        {"role": "user", "content": [{"type": "output_text", "text": "x"}]},  # not a user part
        {"role": "tool", "content": "x"},
        {"type": "function_call", "name": "f", "arguments": "{}"},  # no call_id
        {"type": "computer_call_output", "call_id": "c"},
    ],
)
def test_bad_items_are_400s_on_input(item: dict[str, Any]) -> None:
    with pytest.raises(APIError) as e:
        input_messages([item])
    assert (e.value.status, e.value.param) == (400, "input")


def test_auto_text_then_a_hermes_call_streams_as_the_unary_items() -> None:
    from kvserve.server.tool_parsers import HermesToolParser

    text = 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}\n</tool_call>'
    plan = ToolPlan("auto", parser=HermesToolParser)
    streamed = OutputBuilder(plan)
    evs = events(streamed, *[(text[:n], None) for n in range(1, len(text), 7)], (text, "stop"))
    unary = OutputBuilder(plan)
    unary.step(text, "stop")

    def strip(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]

    assert strip(streamed.output("completed")) == strip(unary.output("completed"))
    message, call = streamed.output("completed")
    assert message["content"][0]["text"] == "Checking.\n"
    assert (call["name"], json.loads(call["arguments"])) == ("f", {"city": "Oslo"})
    types = [e["type"] for e in evs]
    # the message is done before the call is added; each item is added once and done once
    assert types.index("response.output_item.done") < types.index(
        "response.function_call_arguments.delta"
    )
    assert (
        types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    )
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1]


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input",
         "input item type 'computer_call_output' is not supported"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools",
         "tool type 'web_search' is not supported"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice",
         "is not supported: give 'none', 'auto', 'required'"),
    ],
)  # fmt: skip
def test_unpublished_types_are_refused_by_name(
    body: dict[str, Any], param: str, named: str
) -> None:
    with pytest.raises(APIError) as e:
        ResponsesRequest.model_validate(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert named in e.value.message


def test_typed_items_translate_as_the_raw_ones() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "refusal", "refusal": "no"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ]  # fmt: skip
    named = {"type": "function", "name": "f"}
    req = ResponsesRequest.model_validate({"input": items, "tools": [named], "tool_choice": named})
    assert [type(i).__name__ for i in req.input] == [
        "InputMessage", "AssistantMessage", "FunctionCallItem", "FunctionCallOutputItem",
    ]  # fmt: skip
    assert input_messages(req.input) == input_messages(items)
    chat = to_chat_request(req, [], input_messages(req.input))
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "f"  # type: ignore[union-attr]


def test_neutral_fields_are_published_as_what_is_accepted() -> None:
    props = ResponsesRequest.model_json_schema()["properties"]
    assert props["conversation"]["anyOf"] == [{"type": "null"}]
    assert props["background"]["anyOf"][0] == {"type": "boolean", "enum": [False]}
    assert props["truncation"]["anyOf"][0] == {"type": "string", "enum": ["disabled"]}
    assert props["include"]["anyOf"][0]["items"]["enum"] == ["reasoning.encrypted_content"]


@pytest.mark.parametrize("auto", [True, False])
def test_tool_choice_auto_is_published_only_with_auto_tool_choice(auto: bool) -> None:
    limits = PublishedLimits(None, 2, 4, 5, 8, 16, False, False, auto_tool_choice=auto)
    choice = {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "null"}]}
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/R"}}}}
    doc: dict[str, Any] = {
        "paths": {"/r": {"post": {"requestBody": body}}},
        "components": {"schemas": {"R": {"properties": {"tool_choice": choice}}}},
    }
    publish_limits(doc, limits)
    enum = doc["components"]["schemas"]["R"]["properties"]["tool_choice"]["anyOf"][0]["enum"]
    assert enum == (["none", "auto", "required"] if auto else ["none", "required"])


@pytest.mark.parametrize("reasoning", [True, False])
def test_thinking_token_budget_is_published_only_with_a_reasoning_parser(
    reasoning: bool,
) -> None:
    limits = PublishedLimits(None, 2, 4, 5, 8, 16, False, False, False, reasoning=reasoning)
    budget = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None}
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/R"}}}}
    doc: dict[str, Any] = {
        "paths": {"/r": {"post": {"requestBody": body}}},
        "components": {"schemas": {"R": {"properties": {"thinking_token_budget": dict(budget)}}}},
    }
    publish_limits(doc, limits)
    got = doc["components"]["schemas"]["R"]["properties"]["thinking_token_budget"]
    assert got == budget if reasoning else got["type"] == "null"
