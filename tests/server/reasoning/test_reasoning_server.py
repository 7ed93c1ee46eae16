"""--reasoning-parser against a real ``kvserve serve`` of the bigram thinking model
(``conftest.py``), whose greedy output is exactly ``<think>I think</think>Hello world``:
chat (``reasoning`` and ``reasoning_content``, unary and streamed), Messages (``thinking``
blocks and ``thinking_delta``), thinking turned off, the grammar applied after the thinking,
the thinking budget, a model without the markers refused at startup, and gpt-oss's harmony
format (``gpt_oss``) on a bigram model of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import Server, start_server
from tests.server.reasoning.conftest import ANSWER, HARMONY_MODEL, REASONING, THINK_MODEL
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


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "enum": ["Hello world"]}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_the_grammar_applies_after_the_thinking(thinker_server: Server) -> None:
    """vLLM's rule: the thinking is free, the grammar constrains the answer after </think>.
    The bigram model writes <think>I think</think> by itself (no grammar could allow <think>
    as JSON's first token), then only the schema's JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    r = chat(thinker_server, response_format=fmt, max_tokens=128)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == REASONING
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert json.loads(message["content"]) == {"a": "Hello world"}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    # thinking off: the grammar covers the whole output, as before
    regex = {"structured_outputs": {"regex": "Hello"}}
    r = chat(thinker_server, chat_template_kwargs=OFF, **regex)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"


def test_a_forced_tool_call_after_the_thinking(thinker_server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        r = chat(thinker_server, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                 max_tokens=128)  # fmt: skip
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["reasoning"] == REASONING
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "f"
        assert json.loads(call["function"]["arguments"]) == {"a": "Hello world"}


@pytest.mark.parametrize(
    ("budget", "reasoning", "tokens"),
    [(0, None, 5), (1, "I", 6), (2, REASONING, 7), (5, REASONING, 7)],
)
def test_thinking_token_budget(
    thinker_server: Server, budget: int, reasoning: str | None, tokens: int
) -> None:
    """After ``budget`` thinking tokens </think> is forced and the answer goes on: the
    unbounded output is <think> I think </think> Hello world <|im_end|> (7 tokens)."""
    r = chat(thinker_server, thinking_token_budget=budget)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message.get("reasoning") == reasoning and message["content"] == ANSWER
    assert body["usage"]["completion_tokens"] == tokens
    stream = {"model": THINK_MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": True,
              "thinking_token_budget": budget}  # fmt: skip
    *chunks, _ = sse_events(thinker_server, "/v1/chat/completions", stream)
    deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
    assert "".join(d.get("reasoning", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_thinking_budget_bad_values(thinker_server: Server) -> None:
    r = chat(thinker_server, thinking_token_budget=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    # thinking off: nothing to bound, the answer as usual
    r = chat(thinker_server, thinking_token_budget=1, chat_template_kwargs=OFF)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


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


def test_messages_budget_tokens_and_a_forced_tool(thinker_server: Server) -> None:
    c = _anthropic(thinker_server)
    m = c.messages.create(
        model=THINK_MODEL, max_tokens=16, messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 1},
    )  # fmt: skip
    assert [b.model_dump(exclude_none=True) for b in m.content] == [
        {"type": "thinking", "thinking": "I", "signature": ""},
        {"type": "text", "text": ANSWER},
    ]
    assert m.usage.output_tokens == 6  # <think> I </think>(forced) Hello world <|im_end|>
    tool = {"name": "f", "input_schema": SCHEMA}
    m = c.messages.create(
        model=THINK_MODEL, max_tokens=128, messages=MESSAGES, tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert m.stop_reason == "tool_use"
    thinking, call = m.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING  # type: ignore[union-attr]
    assert call.type == "tool_use" and call.input == {"a": "Hello world"}  # type: ignore[union-attr]


def test_a_model_without_the_markers_is_refused_at_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="server exited with 1") as e:
        start_server([str(tiny_model_dir), "--reasoning-parser", "deepseek_r1"], tmp_path / "log")
    assert "has no <think> or </think> token" in str(e.value)


def test_gpt_oss_harmony(harmony_server: Server) -> None:
    """The harmony bigram model (conftest.py) writes one analysis message; with a budget of
    one token the engine forces <|end|><|start|>assistant<|channel|>final<|message|> and the
    model writes its words again as the final answer. Unary and streamed alike."""
    client = harmony_server.client()
    kw: dict[str, Any] = {"model": HARMONY_MODEL, "messages": MESSAGES, "max_tokens": 32}
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message.model_dump()
    assert (message["reasoning"], message["content"]) == ("Hello world", None)
    assert r.usage.completion_tokens == 7  # 3 header tokens, Hello, world, <|return|>, EOS
    budget = {"thinking_token_budget": 1}
    r = client.chat.completions.create(**kw, extra_body=budget)
    message = r.choices[0].message.model_dump()
    assert (message["reasoning"], message["content"]) == ("Hello", "Hello world")
    got = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, extra_body=budget, stream=True):
        for key in got:
            got[key] += getattr(chunk.choices[0].delta, key, None) or ""
    assert got == {"reasoning": "Hello", "content": "Hello world"}
