"""kvserve/server/tools.py without a model: tool_choice rules, the grammar's schema, turning
outputs into tool calls (whole and streamed alike), the chat template's inputs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.tools import (
    AUTO_TOOL_CHOICE_ERROR,
    UNTRUSTED_TEMPLATE_ERROR,
    ChatOptions,
    ToolPlan,
    merge_deltas,
    parse_required,
    plan_tools,
    required_schema,
    template_args,
    template_conversation,
)
from kvserve.structured_output import StructuredOutputsParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ORDER = {
    "type": "function",
    "function": {
        "name": "place_order",
        "parameters": {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}, "qty": {"type": "integer"}},
            "required": ["item", "qty"],
            "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "now"}}
AUTO = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
USER = [{"role": "user", "content": "hi"}]


def request(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def plan(options: ChatOptions = AUTO, **kw: Any) -> ToolPlan:
    return plan_tools(request(**kw), options)


def api_error(fn: Any, *args: Any, **kw: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


# -- tool_choice --------------------------------------------------------------------------------
def test_tool_choice_defaults_as_vllm() -> None:
    assert plan().mode == "none" and plan().template_tools is None
    assert plan(tools=[WEATHER]).mode == "auto"  # tools without tool_choice: auto
    assert plan(tools=[WEATHER], tool_choice="none").mode == "none"
    assert plan(tools=[], tool_choice="required").mode == "none"  # vLLM: no tools, no call


def test_tool_choice_errors_are_vllms() -> None:
    e = api_error(plan, tool_choice="required")
    assert (
        e.message == "When using `tool_choice`, `tools` must be set." and e.param == "tool_choice"
    )
    named = {"type": "function", "function": {"name": "nope"}}
    e = api_error(plan, tools=[WEATHER], tool_choice=named)
    assert "does not match any of the specified `tools`" in e.message
    # auto needs the server flags
    e = api_error(plan, ChatOptions(), tools=[WEATHER])
    assert e.message == AUTO_TOOL_CHOICE_ERROR
    assert plan(ChatOptions(), tools=[WEATHER], tool_choice="required").mode == "required"
    # bad tools
    e = api_error(plan, tools=[WEATHER, WEATHER], tool_choice="required")
    assert "given twice" in e.message and e.param == "tools"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert "type object" in api_error(plan, tools=[bad], tool_choice="required").message
    bad = {"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}
    assert "required" in api_error(plan, tools=[bad], tool_choice="none").message
    bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}
    api_error(plan, tools=[bad], tool_choice="required")


def test_invalid_tool_fields_fail_validation() -> None:
    with pytest.raises(ValueError):
        request(tools=[{"type": "function", "function": {"name": ""}}])
    with pytest.raises(ValueError):
        request(tools=[WEATHER], tool_choice="sometimes")
    with pytest.raises(ValueError, match="continue_final_message"):
        request(continue_final_message=True)  # add_generation_prompt is true by default
    request(continue_final_message=True, add_generation_prompt=False)


def test_chat_options_check_the_flags() -> None:
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ChatOptions(tool_call_parser="nope")


def test_exclude_tools_when_none() -> None:
    assert plan(tools=[WEATHER], tool_choice="none").template_tools == [WEATHER]
    opts = ChatOptions(exclude_tools_when_tool_choice_none=True)
    assert plan(opts, tools=[WEATHER], tool_choice="none").template_tools is None
    assert plan(opts, tools=[WEATHER], tool_choice="required").template_tools == [WEATHER]


# -- the grammar --------------------------------------------------------------------------------
def test_required_schema_accepts_calls_and_refuses_others() -> None:
    tools = request(tools=[WEATHER, ORDER, NOARGS]).tools or []
    schema = required_schema(tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
        {"name": "place_order", "parameters": {"item": {"sku": "A1"}, "qty": 2}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(ok, schema)
    for bad in (
        [],  # at least one call
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],  # a required argument
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "kelvin"}}],
        [{"name": "place_order", "parameters": {"item": {"sku": 1}, "qty": 2}}],  # via $ref
        [{"name": "nope", "parameters": {}}],
        [{"name": "now", "parameters": {}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["$defs"] == {"Item": ORDER["function"]["parameters"]["$defs"]["Item"]}
    assert "$defs" in ORDER["function"]["parameters"]  # the request's tool is untouched
    one = required_schema(tools, parallel=False)
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)


def test_conflicting_defs_are_refused() -> None:
    other = json.loads(json.dumps(ORDER))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["Item"] = {"type": "string"}
    e = api_error(plan, tools=[ORDER, other], tool_choice="required")
    assert "multiple schemas" in e.message


def test_grammar_goes_into_sampling_params() -> None:
    named = plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    params = SamplingParams(max_tokens=8)
    named.apply_grammar(params)
    assert params.structured_outputs == StructuredOutputsParams(
        json=WEATHER["function"]["parameters"]
    )
    params = SamplingParams(max_tokens=8)
    plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).apply_grammar(params)
    assert params.structured_outputs is not None
    assert isinstance(params.structured_outputs.json, dict)
    assert params.structured_outputs.json["maxItems"] == 1
    params = SamplingParams(max_tokens=8)
    plan(tools=[WEATHER]).apply_grammar(params)  # auto: no grammar
    assert params.structured_outputs is None
    taken = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    e = api_error(named.apply_grammar, taken)
    assert e.param == "tool_choice" and "not both" in e.message
    plan(tools=[WEATHER]).apply_grammar(taken)  # auto with the user's own grammar is fine


# -- outputs into tool calls --------------------------------------------------------------------
def streamed(p: ToolPlan, text: str, finish: str, step: int) -> tuple[str, list[Any], str | None]:
    s = p.streamer()
    content, calls, reason = "", {}, None
    for end in range(step, len(text) + step, step):
        last = end >= len(text)
        delta, reason = s.step(text[:end], finish if last else None)
        assert (reason is None) != last
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc.get("function", {}).get("name") or ""
            c["arguments"] += tc.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)], reason


def same_whole_and_streamed(p: ToolPlan, text: str, finish: str) -> tuple[Any, str | None]:
    """The streamed deltas add up to the non-streamed message, for several chunkings."""
    msg, reason = p.message(text, finish)
    want = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []
    ]
    for step in (1, 3, 8, len(text)):
        content, calls, sreason = streamed(p, text, finish, step)
        assert (content, calls, sreason) == (msg.content or "", want, reason), step
    return msg, reason


def test_named_output() -> None:
    p = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg, reason = same_whole_and_streamed(p, '{"city": "Oslo", "unit": "celsius"}', "stop")
    assert reason == "stop" and msg.content is None  # named calls finish with "stop" (vLLM)
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}


def test_required_output() -> None:
    p = plan(tools=[WEATHER, NOARGS], tool_choice="required")
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, '
        '{"name": "now", "parameters": {}}]'
    )
    msg, reason = same_whole_and_streamed(p, text, "stop")
    assert reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("now", {}),
    ]
    # cut by max_tokens: what was generated, finish reason "length"
    msg, reason = same_whole_and_streamed(p, text[:60], "length")
    assert reason == "length" and [c.function.name for c in msg.tool_calls] == ["get_weather"]
    # cut before any name: the text is content
    msg, reason = same_whole_and_streamed(p, '[{"na', "length")
    assert msg.tool_calls is None and msg.content == '[{"na' and reason == "length"


def test_parse_required_never_raises() -> None:
    assert parse_required("").calls == []
    assert parse_required("nonsense").calls == []
    assert [c.name for c in parse_required('[{"name": "a", "parameters": {}} x').calls] == ["a"]
    assert parse_required('[{"name": "a", "parameters": {}}, 3]').calls[0].name == "a"


def test_auto_output() -> None:
    p = plan(tools=[WEATHER])
    text = (
        'Sure.<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    )
    msg, reason = same_whole_and_streamed(p, text, "stop")
    assert reason == "tool_calls" and msg.content == "Sure."
    msg, reason = same_whole_and_streamed(p, "No tools needed.", "stop")
    assert reason == "stop" and msg.content == "No tools needed." and msg.tool_calls is None
    p = plan(tools=[WEATHER], parallel_tool_calls=False)
    msg, _ = same_whole_and_streamed(p, text + text, "stop")
    assert len(msg.tool_calls) == 1


def test_merge_deltas_joins_a_calls_fragments() -> None:
    p = plan(tools=[WEATHER])
    s = p.streamer()
    assert s.step("<tool_call>", None) == ({}, None)
    delta, reason = s.step('<tool_call>{"name": "get_weather", "arguments": {}}', "stop")
    assert reason == "tool_calls"
    (tc,) = delta["tool_calls"]  # announced and finished in one chunk: one entry
    assert tc["function"] == {"name": "get_weather", "arguments": "{}"}
    assert merge_deltas(None, None) is None


# -- the chat template's inputs -----------------------------------------------------------------
def test_template_conversation() -> None:
    msgs = [
        ChatMessage.model_validate(m)
        for m in [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "bob"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        ]
    ]
    conv = template_conversation(msgs)
    assert conv[0] == {"role": "system", "content": "Be brief."}
    assert conv[1] == {"role": "user", "content": "Weather?", "name": "bob"}
    assert conv[2]["content"] == "" and conv[2]["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            "id": "c1",
        },
        {"type": "function", "function": {"name": "now", "arguments": {}}, "id": "c2"},
    ]
    assert conv[3] == {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}
    bad = ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    )
    assert "not a JSON object" in api_error(template_conversation, [bad]).message
    bad = ChatMessage.model_validate(
        {"role": "user", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    )
    assert "only assistant" in api_error(template_conversation, [bad]).message


def test_template_args_trust_and_kwargs() -> None:
    e = api_error(template_args, ChatOptions(), chat_template="{{ 1 }}")
    assert e.message == UNTRUSTED_TEMPLATE_ERROR
    e = api_error(template_args, ChatOptions(), chat_template_kwargs={"chat_template": "x"})
    assert e.message == UNTRUSTED_TEMPLATE_ERROR
    trusted = ChatOptions(trust_request_chat_template=True)
    args = template_args(trusted, chat_template_kwargs={"chat_template": "T", "x": 1})
    assert args.chat_template == "T" and args.kwargs == {"x": 1}
    args = template_args(
        ChatOptions(),
        chat_template_kwargs={
            "enable_thinking": False,
            "tokenize": True,
            "tools": [],
            "messages": 1,
        },
    )
    assert args.kwargs == {"enable_thinking": False}  # apply_chat_template's own names dropped
