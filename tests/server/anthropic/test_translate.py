"""Anthropic's request -> the chat request (no server): exact translations and 400s."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.server.anthropic.messages import BlockEvents, stop_reason
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.server.anthropic.translate import check_unsupported_fields, to_chat_request
from kvserve.server.errors import APIError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def chat(**body: Any) -> dict[str, Any]:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})
    return to_chat_request(req).model_dump(exclude_unset=True, by_alias=True)


def test_a_tool_round_trip_conversation() -> None:
    got = chat(
        system=[{"type": "text", "text": "Be terse."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "18 C"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                {"type": "text", "text": "Thanks"},
            ]},
        ],
        tools=[{"name": "get_weather", "description": "d", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=4,
        thinking={"type": "disabled"}, metadata={"user_id": "u"},
    )  # fmt: skip
    assert got["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [{"id": "t1", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}],
         "reasoning": "Use the tool."},
        {"role": "tool", "tool_call_id": "t1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]  # fmt: skip
    assert got["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "d", "parameters": SCHEMA},
        }
    ]
    assert got["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert got["parallel_tool_calls"] is False
    assert (got["stop"], got["temperature"], got["top_p"], got["top_k"]) == (["END"], 0.5, 0.9, 4)
    assert got["chat_template_kwargs"] == {"enable_thinking": False}
    assert got["max_tokens"] == 8 and "continue_final_message" not in got


@pytest.mark.parametrize(
    ("anthropic", "openai"), [("auto", "auto"), ("any", "required"), ("none", "none")]
)
def test_tool_choice(anthropic: str, openai: str) -> None:
    got = chat(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": anthropic})
    assert got["tool_choice"] == openai


def test_prefill_and_output_format() -> None:
    got = chat(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert got["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}
    }  # fmt: skip


def test_count_tokens_request_has_no_sampling() -> None:
    req = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s"}
    )
    got = to_chat_request(req).model_dump(exclude_unset=True)
    assert got == {"model": "m", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}  # fmt: skip


HI = [{"role": "user", "content": "hi"}]
REFUSED = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]}, "'tool_result'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": HI, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    ({"messages": HI, "tool_choice": {"type": "tool"}}, "needs the tool's 'name'"),
    ({"messages": HI, "system": [{"type": "image", "source": {}}]}, "system blocks must be text"),
    ({"messages": HI, "output_config": {"effort": "low"}}, "effort 'low' is not supported"),
    ({"messages": [*HI, {"role": "system", "content": [{"type": "image", "source": {}}]}]},
     r"messages\[1\].content\[0\]: system blocks must be text"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024,
                                    "display": "omitted"}}, "omitted"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "says"), REFUSED)
def test_refused(body: dict[str, Any], says: str) -> None:
    with pytest.raises(APIError, match=says) as e:
        chat(**body)
    assert e.value.status == 400


def test_unsupported_fields() -> None:
    check_unsupported_fields({"mcp_servers": None, "metadata": {}})  # null: not given
    with pytest.raises(APIError, match="mcp_servers"):
        check_unsupported_fields({"mcp_servers": []})
    # Claude Code's context edit that keeps all thinking changes nothing: accepted
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    check_unsupported_fields({"context_management": keep_all})
    for edits in (
        [{"type": "clear_tool_uses_20250919"}],
        [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}],
    ):
        with pytest.raises(APIError, match="context_management") as e:
            check_unsupported_fields({"context_management": {"edits": edits}})
        assert e.value.param == "context_management"


def test_claude_codes_request_shape() -> None:
    """What Claude Code 2.1 sends (recorded against kvserve): system blocks with
    cache_control, a system message after the user's, adaptive thinking, effort "high"."""
    req = chat(
        system=[{"type": "text", "text": "You are an agent.",
                 "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say hi",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Agent types: ..."},
        ],
        thinking={"type": "adaptive"}, output_config={"effort": "high"},
    )  # fmt: skip
    assert req["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
        {"role": "system", "content": "Agent types: ..."},
    ]
    assert "continue_final_message" not in req  # a last system message is no prefill


def test_stop_reason() -> None:
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # the EOS token id
    assert stop_reason("stop", None, False) == ("end_turn", None)


def test_block_events_open_and_close_blocks_in_order() -> None:
    blocks = BlockEvents()
    events = [
        *blocks.feed({"reasoning": "a", "reasoning_content": "a"}),
        *blocks.feed({"content": "b"}),
        *blocks.feed({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                      "function": {"name": "f", "arguments": "{"}}]}),
        *blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
        *blocks.close(),
    ]  # fmt: skip
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert kinds == [
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
    ]  # fmt: skip
    assert blocks.called_tools and blocks.index == 2
