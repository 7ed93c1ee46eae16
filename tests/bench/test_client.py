"""The streaming client against a real local HTTP server with known chunk timings."""

from __future__ import annotations

import pytest

from kvserve.bench.client import (
    RequestInput,
    SSEDecoder,
    build_headers,
    choose_model_name,
    make_session,
    request_chat,
    request_completions,
)
from kvserve.bench.sweep import free_port

# The fake server pauses 0.2 s before the first piece and 0.1 s before each next one. Lower
# bounds are exact (sleeps never end early, minus timer granularity); upper bounds only catch
# gross errors, so a busy CI machine cannot make the tests flaky.
SLACK = 1.0


def _input(base_url: str, endpoint: str = "/v1/completions", **kw) -> RequestInput:
    return RequestInput(
        api_url=base_url + endpoint,
        model="fake-model",
        prompt="Say hello",
        prompt_len=9,
        max_tokens=3,
        headers=build_headers("secret-key"),
        **kw,
    )


async def test_completions_timings_and_usage(fake_server) -> None:
    inp = _input(fake_server.base_url, ignore_eos=True, extra_body={"top_k": 5})
    async with make_session(30) as session:
        rec = await request_completions(session, inp)
    assert rec.success, rec.error
    assert rec.generated_text == "Hello big world"
    assert 0.2 <= rec.ttft < 0.2 + SLACK
    assert len(rec.itl) == 2 and all(0.09 <= gap < 0.1 + SLACK for gap in rec.itl)
    assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl))
    assert rec.latency - rec.ttft >= 0.18  # TTFT is the first piece, not a later one
    assert (rec.prompt_len, rec.output_tokens, rec.output_tokens_source) == (7, 3, "usage")
    assert rec.finish_reason == "length" and rec.http_status == 200
    body = fake_server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["top_k"]) == (3, True, 5)
    assert body["prompt"] == "Say hello" and body["model"] == "fake-model"
    assert fake_server.headers[0]["Authorization"] == "Bearer secret-key"


async def test_chat_role_delta_is_not_a_token(fake_server) -> None:
    inp = _input(fake_server.base_url, "/v1/chat/completions")
    async with make_session(30) as session:
        rec = await request_chat(session, inp)
    assert rec.success, rec.error
    assert rec.ttft >= 0.2  # the role-only delta sent at once did not count
    assert rec.generated_text == "Hello big world" and len(rec.itl) == 2
    body = fake_server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "Say hello"}]
    assert body["max_completion_tokens"] == 3 and "ignore_eos" not in body


async def test_multi_token_chunk_is_one_gap(fake_server) -> None:
    fake_server.pieces, fake_server.delays = ["Hello", " big world again"], [0.05, 0.1]
    fake_server.usage = {"prompt_tokens": 9, "completion_tokens": 5}
    async with make_session(30) as session:
        rec = await request_completions(session, _input(fake_server.base_url))
    assert len(rec.itl) == 1 and rec.output_tokens == 5


async def test_output_count_without_usage(fake_server, byte_tokenizer) -> None:
    fake_server.usage = None
    counter = lambda text: len(byte_tokenizer(text).input_ids)  # noqa: E731
    async with make_session(30) as session:
        rec = await request_completions(session, _input(fake_server.base_url), counter)
        bare = await request_completions(session, _input(fake_server.base_url))
    assert (rec.output_tokens, rec.output_tokens_source, rec.prompt_len) == (15, "tokenizer", 9)
    assert (bare.output_tokens, bare.output_tokens_source) == (3, "chunks")


async def test_http_error_gives_failed_record(fake_server) -> None:
    fake_server.fail_status = 500
    async with make_session(30) as session:
        rec = await request_completions(session, _input(fake_server.base_url))
    assert not rec.success and rec.http_status == 500
    assert rec.error.startswith("HTTP 500") and "engine exploded: out of blocks" in rec.error


async def test_cut_stream_is_a_failure(fake_server) -> None:
    fake_server.cut_after = 1
    async with make_session(30) as session:
        rec = await request_completions(session, _input(fake_server.base_url))
    assert not rec.success and "cut off" in rec.error and rec.generated_text == "Hello"


async def test_connection_refused_is_a_failure() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with make_session(5) as session:
        rec = await request_completions(session, _input(dead))
    assert not rec.success and "Connect" in rec.error


async def test_model_name_choice(fake_server) -> None:
    url = fake_server.base_url
    async with make_session(5) as session:
        assert await choose_model_name(session, url, None, None) == "fake-model"
        assert await choose_model_name(session, url, "/models/fake-model", None) == "fake-model"
        assert await choose_model_name(session, url, "/x/fake-model.gguf", None) == "fake-model"
        assert await choose_model_name(session, url, "other", None) == "other"
        assert await choose_model_name(session, url, "/m/x", "served") == "served"
        dead = f"http://127.0.0.1:{free_port()}"
        assert await choose_model_name(session, dead, "given", None) == "given"


def test_sse_decoder_framing() -> None:
    dec = SSEDecoder()
    euro = 'data: {"t": "€"}\n\n'.encode()
    split = euro.index("€".encode()) + 1  # cut inside the 3-byte character
    out = list(dec.feed(b": ping\r\n\r\n" + euro[:split]))
    out += list(dec.feed(euro[split:] + b"data: line1\ndata: line2\n\ndata: [DONE]"))
    out += list(dec.flush())
    assert out == ['{"t": "€"}', "line1\nline2", "[DONE]"]
