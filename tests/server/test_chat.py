"""/v1/chat/completions through the official openai client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvserve.server.protocol import ChatCompletionChunk
from tests.server.conftest import BUILTIN, Server
from tests.server.test_completions import (
    assert_chunks_are_the_models_json,
    raw_sse_events,
    sse_events,
)

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colors."},
]


def chat_prompt_len(server: Server, messages: list[dict[str, object]]) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=server.headers())
    return int(r.json()["count"])


def test_chat_completion(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=BUILTIN,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.object == "chat.completion" and r.model == BUILTIN and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == chat_prompt_len(server, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 10


def test_max_completion_tokens_and_text_parts(server: Server) -> None:
    client = server.client()
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]},
    ]
    a = client.chat.completions.create(
        model=BUILTIN, messages=MESSAGES, max_completion_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    b = client.chat.completions.create(
        model=BUILTIN, messages=parts, max_completion_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert a.usage.completion_tokens == 6 and a.choices[0].finish_reason == "length"
    assert b.choices[0].message.content == a.choices[0].message.content


def test_chat_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    kw = {"model": BUILTIN, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**kw, stream=True))  # type: ignore[call-overload]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_include_usage_follows_the_spec(server: Server) -> None:
    body = {"model": BUILTIN, "messages": MESSAGES, "max_tokens": 5, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    plain = sse_events(server, "/v1/chat/completions", body)
    assert plain[-1] == "[DONE]" and all("usage" not in e for e in plain[:-1])  # type: ignore[operator]
    events = sse_events(
        server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    *chunks, last, done = events
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)  # type: ignore[index]
    assert last["choices"] == []  # type: ignore[index]
    usage = dict(last["usage"])  # type: ignore[index]
    # Whole 16-token blocks of the chat template found in the prefix cache (this shared server
    # has served the same template before), never the last prompt token.
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert cached % 16 == 0 and 0 <= cached < chat_prompt_len(server, MESSAGES)
    assert usage == {
        "prompt_tokens": chat_prompt_len(server, MESSAGES),
        "completion_tokens": 5,
        "total_tokens": chat_prompt_len(server, MESSAGES) + 5,
    }


def test_chat_n_and_seed(server: Server) -> None:
    client = server.client()
    kw = {"model": BUILTIN, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0,
          "n": 2, "seed": 99, "extra_body": {"ignore_eos": True}}  # fmt: skip
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    assert a.usage.completion_tokens == 16
    assert a.usage.prompt_tokens == chat_prompt_len(server, MESSAGES)  # once, not per choice


def test_chat_logprobs(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=BUILTIN, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert content is not None and len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.bytes == list(t.token.encode())
        assert all(x.logprob <= 0 for x in t.top_logprobs)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        # Greedy takes a most likely token: the first one, or one tied with it (bf16 logits
        # tie often; topk may list the other token of a tie first).
        assert t.logprob == t.top_logprobs[0].logprob
        assert t.token in {x.token for x in t.top_logprobs if x.logprob == t.logprob}
    plain = server.client().chat.completions.create(
        model=BUILTIN,
        messages=MESSAGES,
        max_tokens=2,
        temperature=0,  # type: ignore[arg-type]
    )
    assert plain.choices[0].logprobs is None


def test_chat_stop_string(server: Server) -> None:
    client = server.client()
    kw = {"model": BUILTIN, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0].message.content  # type: ignore[call-overload]
    stop = full.split()[2]
    r = client.chat.completions.create(**kw, stop=[stop])  # type: ignore[call-overload]
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
         "return_token_ids": True, "ignore_eos": True},
        {"n": 2, "temperature": 0.7, "seed": 3, "stop": ["."]},
    ],
)  # fmt: skip
def test_chat_stream_chunks_are_exactly_the_models_json(
    server: Server, extra: dict[str, Any]
) -> None:
    body = {"model": BUILTIN, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
            "stream": True, **extra}  # fmt: skip
    include_usage = "stream_options" in extra
    events = raw_sse_events(server, "/v1/chat/completions", body)
    chunks = assert_chunks_are_the_models_json(events, ChatCompletionChunk, include_usage)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    n = int(extra.get("n", 1))
    roles = [c["choices"][0] for c in chunks[:n]]
    assert [r["index"] for r in roles] == list(range(n))
    assert all(r["delta"] == {"role": "assistant", "content": ""} for r in roles)
    choices = [ch for c in chunks[n:] for ch in c["choices"]]
    assert all(list(ch)[:5] == ["index", "delta", "logprobs", "finish_reason", "stop_reason"]
               for ch in choices)  # fmt: skip
    assert all(set(ch["delta"]) <= {"content"} for ch in choices)
    assert sorted(ch["index"] for ch in choices if ch["finish_reason"]) == list(range(n))
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        assert len([t for ch in choices for t in ch["token_ids"]]) == 6
        assert len([t for ch in choices for t in ch["logprobs"]["content"]]) == 6
