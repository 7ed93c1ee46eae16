"""/v1/completions through the official openai client: shapes, streaming, n, stop, seed,
logprobs, echo, usage."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from kvserve.server.protocol import CompletionResponse
from kvserve.server.serving import sse
from tests.server.conftest import BUILTIN, Server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def tokenize(server: Server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=server.headers())
    return r.json()["tokens"]


def raw_sse_events(server: Server, path: str, body: dict[str, object]) -> list[str]:
    """The raw SSE payloads, as sent (JSON text, and the literal "[DONE]")."""
    with httpx.stream(
        "POST", f"{server.url}{path}", json=body, headers=server.headers(), timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)  # one line each
    return [e[len("data: ") :] for e in events]


def sse_events(server: Server, path: str, body: dict[str, object]) -> list[object]:
    """The raw SSE payloads (parsed JSON, and the literal "[DONE]")."""
    return [e if e == "[DONE]" else json.loads(e) for e in raw_sse_events(server, path, body)]


def assert_chunks_are_the_models_json(
    events: list[str], model: type[BaseModel], include_usage: bool
) -> list[dict[str, Any]]:
    """Every chunk is byte for byte what ``sse(model(...))`` gives for its values (field order,
    nulls, omitted keys), and they all share one id and created; returns them parsed."""
    *chunks, done = events
    assert done == "[DONE]" and chunks
    parsed = [json.loads(c) for c in chunks]
    for raw, data in zip(chunks, parsed, strict=True):
        assert f"data: {raw}\n\n" == sse(model.model_validate(data), drop_usage=not include_usage)
    assert len({(d["id"], d["created"]) for d in parsed}) == 1
    return parsed


def test_greedy_completion(server: Server) -> None:
    c = server.client().completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.object == "text_completion" and c.model == BUILTIN and c.id.startswith("cmpl-")
    (choice,) = c.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert c.usage is not None
    assert c.usage.prompt_tokens == len(tokenize(server, PROMPT))
    assert c.usage.completion_tokens == 12
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_streamed_text_equals_non_streamed(server: Server) -> None:
    client = server.client()
    full = client.completions.create(model=BUILTIN, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=BUILTIN, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_include_usage_follows_the_spec(server: Server) -> None:
    body = {"model": BUILTIN, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    plain = sse_events(server, "/v1/completions", body)
    assert plain[-1] == "[DONE]"
    assert all("usage" not in e for e in plain[:-1])  # type: ignore[operator]
    events = sse_events(
        server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None and c["choices"] for c in chunks)  # type: ignore[index]
    assert usage_chunk["choices"] == []  # type: ignore[index]
    usage = usage_chunk["usage"]  # type: ignore[index]
    assert usage["prompt_tokens"] == len(tokenize(server, PROMPT))
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_several_prompts_and_n(server: Server) -> None:
    prompts = ["Once upon a time", "The best way to learn is"]
    c = server.client().completions.create(
        model=BUILTIN, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    ids = [tokenize(server, p) for p in prompts]
    for ch in c.choices:
        # choice index = prompt index * n + completion index
        assert ch.model_extra["prompt_token_ids"] == ids[ch.index // 2]
        assert len(ch.model_extra["token_ids"]) == 6
    assert c.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # once per prompt, not per n
    assert c.usage.completion_tokens == 4 * 6
    # n=2 with a seed: distinct (seed, seed + 1) yet reproducible completions.
    assert c.choices[0].text != c.choices[1].text


def test_several_prompts_streamed(server: Server) -> None:
    prompts = ["Once upon a time", "The best way to learn is"]
    kw = {"model": BUILTIN, "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0}
    full = server.client().completions.create(**kw)  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in server.client().completions.create(**kw, stream=True):  # type: ignore[call-overload]
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                assert ch.index not in reasons  # one finish per choice
                reasons[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.text for ch in full.choices}
    assert reasons == {ch.index: ch.finish_reason for ch in full.choices}
    # Greedy: both completions of a prompt agree.
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_stop_strings(server: Server) -> None:
    client = server.client()
    full = (
        client.completions.create(
            model=BUILTIN,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    words = full.split()
    assert len(words) >= 4, full
    stop = words[3]
    cut = full.index(stop)
    for stream in (False, True):
        kw = {"model": BUILTIN, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        res = client.completions.create(**kw, stop=[stop, "@@never@@"], stream=stream)  # type: ignore[call-overload]
        if stream:
            chunks = list(res)
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = res.choices[0].text, res.choices[0].finish_reason
        assert text == full[:cut], (stream, stop, full)
        assert reason == "stop"
    kept = client.completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == full[: cut + len(stop)]


def test_seed_reproducibility(server: Server) -> None:
    client = server.client()

    def run(seed: int) -> str:
        return client.completions.create(
            model=BUILTIN, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    a, b, c = run(1234), run(1234), run(4321)
    assert a == b
    assert a != c


def test_logprobs_shapes(server: Server) -> None:
    c = server.client().completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = c.choices[0]
    lp = choice.logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == choice.text
    for tok, sampled, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3  # greedy: the sampled token is among the top 3
        assert all(v <= 0 for v in top.values())
        assert top[tok] == pytest.approx(sampled) == pytest.approx(max(top.values()))


def test_streamed_logprobs_cover_every_token(server: Server) -> None:
    chunks = list(
        server.client().completions.create(
            model=BUILTIN,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks for o in ch.choices[0].logprobs.text_offset]
    assert len(tokens) == 8
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo(server: Server) -> None:
    client = server.client()
    c = client.completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(model=BUILTIN, prompt=PROMPT, max_tokens=4, temperature=0)
    assert c.choices[0].text == PROMPT + plain.choices[0].text
    ids = tokenize(server, PROMPT)
    by_ids = client.completions.create(
        model=BUILTIN, prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == c.choices[0].text
    streamed = client.completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text


def test_token_id_prompts(server: Server) -> None:
    client = server.client()
    ids = tokenize(server, PROMPT)
    a = client.completions.create(model=BUILTIN, prompt=ids, max_tokens=6, temperature=0)
    b = client.completions.create(model=BUILTIN, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens == len(ids)
    assert b.usage.prompt_tokens == 2 * len(ids)
    assert [ch.text for ch in b.choices] == [a.choices[0].text] * 2


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "stream_options": {"include_usage": True},
            "logprobs": 2,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        {"prompt": [PROMPT, "Hello"], "n": 2, "echo": True, "stop": ["."]},
    ],
)
def test_stream_chunks_are_exactly_the_models_json(server: Server, extra: dict[str, Any]) -> None:
    body = {"model": BUILTIN, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "stream": True, **extra}  # fmt: skip
    include_usage = "stream_options" in extra
    events = raw_sse_events(server, "/v1/completions", body)
    chunks = assert_chunks_are_the_models_json(events, CompletionResponse, include_usage)
    assert all(c["object"] == "text_completion" and c["model"] == BUILTIN for c in chunks)
    choices = [ch for c in chunks for ch in c["choices"]]
    assert all(list(ch)[:5] == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
               for ch in choices)  # fmt: skip
    assert all(("token_ids" in ch) == bool(extra.get("return_token_ids")) for ch in choices)
    assert all("prompt_token_ids" not in ch for ch in choices)
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        ids = [t for ch in choices for t in ch["token_ids"]]
        assert len(ids) == 6
        assert sum(len(ch["logprobs"]["tokens"]) for ch in choices) == 6
