"""--reasoning-parser against a real ``kvserve serve`` of the bigram thinking model
(``conftest.py``), whose greedy output is exactly ``<think>I think</think>Hello world``:
chat (``reasoning`` and ``reasoning_content``, unary and streamed), Messages (``thinking``
blocks and ``thinking_delta``), thinking turned off, the grammar combinations refused, and a
model without the markers refused at startup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.conftest import Server, start_server
from tests.server.reasoning.conftest import ANSWER, REASONING, THINK_MODEL
from tests.server.test_completions import sse_events

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hi"}]
OFF = {"enable_thinking": False}


def chat(server: Server, **kw: Any) -> httpx.Response:
    body = {"model": THINK_MODEL, "messages": MESSAGES, "max_tokens": 16, **kw}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_chat_splits_the_thinking(thinker_server: Server) -> None:
    r = thinker_server.client().chat.completions.create(
        model=THINK_MODEL, messages=MESSAGES, max_tokens=16,  # type: ignore[arg-type]
    )  # fmt: skip
    (choice,) = r.choices
    message = choice.message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] == REASONING
    assert message["content"] == ANSWER and choice.finish_reason == "stop"
    assert r.usage.completion_tokens == 7  # <think> I think </think> Hello world <|im_end|>


def test_chat_stream_sends_both_names(thinker_server: Server) -> None:
    body = {"model": THINK_MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": True}
    *chunks, done = sse_events(thinker_server, "/v1/chat/completions", body)
    assert done == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
    got = {k: "".join(d.get(k, "") for d in deltas) for k in ("reasoning", "content")}
    assert got == {"reasoning": REASONING, "content": ANSWER}
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]


def test_enable_thinking_false(thinker_server: Server) -> None:
    r = chat(thinker_server, chat_template_kwargs=OFF)
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER}  # no reasoning keys at all


def test_grammar_with_thinking_is_refused_and_works_without(thinker_server: Server) -> None:
    regex = {"structured_outputs": {"regex": "Hello"}}
    r = chat(thinker_server, **regex)
    assert r.status_code == 400 and "enable_thinking" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "structured_outputs"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = chat(thinker_server, tools=tools, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = chat(thinker_server, chat_template_kwargs=OFF, **regex)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"


def test_responses_reasoning_item(thinker_server: Server) -> None:
    """/v1/responses: the thinking is a ``reasoning`` item before the message, unary and
    streamed alike (the stream's reasoning_text deltas add up to it)."""
    client = thinker_server.client()
    r = client.responses.create(model=THINK_MODEL, input="Hi", max_output_tokens=16)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [c.text for c in reasoning.content or []] == [REASONING]
    assert r.output_text == ANSWER
    with client.responses.stream(model=THINK_MODEL, input="Hi", max_output_tokens=16) as s:
        events = list(s)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (REASONING, ANSWER)


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def test_messages_thinking_blocks(thinker_server: Server) -> None:
    c = _anthropic(thinker_server)
    m = c.messages.create(model=THINK_MODEL, max_tokens=16, messages=MESSAGES)
    assert [b.model_dump(exclude_none=True) for b in m.content] == [
        {"type": "thinking", "thinking": REASONING, "signature": ""},
        {"type": "text", "text": ANSWER},
    ]
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == 7
    with c.messages.stream(model=THINK_MODEL, max_tokens=16, messages=MESSAGES) as s:
        events = [e.type for e in s]
        streamed = s.get_final_message()
    assert "thinking" in events and "text" in events  # the SDK's thinking_delta / text_delta
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == [
        b.model_dump(exclude_none=True) for b in m.content
    ]
    assert streamed.usage.output_tokens == m.usage.output_tokens

    off = c.messages.create(
        model=THINK_MODEL, max_tokens=16, messages=MESSAGES, thinking={"type": "disabled"}
    )
    assert [b.model_dump(exclude_none=True) for b in off.content] == [
        {"type": "text", "text": ANSWER}
    ]


def test_messages_thinking_delta_events(thinker_server: Server) -> None:
    body = {"model": THINK_MODEL, "max_tokens": 16, "messages": MESSAGES, "stream": True}
    url = f"{thinker_server.url}/v1/messages"
    text = httpx.post(url, json=body, timeout=60).text
    datas = [json.loads(e.split("\n")[1][6:]) for e in text.strip().split("\n\n")]
    starts = [d["content_block"]["type"] for d in datas if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = [d["delta"]["thinking"] for d in datas if d["type"] == "content_block_delta"
                and d["delta"]["type"] == "thinking_delta"]  # fmt: skip
    assert "".join(thinking) == REASONING


def test_messages_forced_tool_with_thinking_is_refused(thinker_server: Server) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match="disabled"):
        _anthropic(thinker_server).messages.create(
            model=THINK_MODEL, max_tokens=16, messages=MESSAGES, tools=[tool],
            tool_choice={"type": "any"},
        )  # fmt: skip
    m = _anthropic(thinker_server).messages.create(
        model=THINK_MODEL, max_tokens=16, messages=MESSAGES, tools=[tool],
        tool_choice={"type": "tool", "name": "f"}, thinking={"type": "disabled"},
    )  # fmt: skip
    # the bigram model has no idea of JSON: the grammar may run to max_tokens in whitespace
    assert m.stop_reason in ("tool_use", "max_tokens")
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "f")]  # type: ignore[union-attr]


def test_a_model_without_the_markers_is_refused_at_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="server exited with 1") as e:
        start_server([str(tiny_model_dir), "--reasoning-parser", "deepseek_r1"], tmp_path / "log")
    assert "has no <think> or </think> token" in str(e.value)
