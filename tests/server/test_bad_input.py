"""Malformed input is a 4xx in OpenAI's shape, never a 500, and never costs the connection.

Raw bodies and headers (bytes) go through httpx, since the ``openai`` client cannot send a lone
surrogate, NaN or a non-ASCII header. Every case names the exact status, ``param`` and ``code``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, BUILTIN, TINY, Server

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried ``r`` (same port: same connection)."""
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def assert_400(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == param, err
    return str(err["message"])


# JSON text with \u escapes written out, exactly as a client would put them on the wire.
SURROGATE_BODIES = [
    ("/v1/completions", f'{{"model": "{TINY}", "prompt": "a \\ud800 b"}}'.encode(), "prompt"),
    ("/v1/completions", f'{{"model": "{TINY}", "prompt": ["ok", "\\uDFFF"]}}'.encode(), "prompt"),
    ("/tokenize", f'{{"model": "{TINY}", "prompt": "\\udc00"}}'.encode(), "prompt"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    (
        "/v1/chat/completions",
        f'{{"model": "{TINY}", "messages": [{{"role": "user", "content": "\\ud83d"}}]}}'.encode(),
        "messages",
    ),
    ("/detokenize", f'{{"model": "{TINY}", "tokens": [1], "\\ud800": 0}}'.encode(), None),  # a key
    # The surrogate as UTF-8-style bytes, not an escape: json.loads lets those through too.
    ("/v1/completions", f'{{"model": "{TINY}", "prompt": "'.encode() + b'\xed\xa0\x80"}', "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_lone_surrogate_is_400_and_the_connection_lives_on(
    server: Server, path: str, body: bytes, param: str | None
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post(path, content=body, headers=AUTH)
        message = assert_400(r, param)
        assert "lone UTF-16 surrogate" in message
        assert r.headers.get("connection") != "close"
        health = client.get("/health")
        assert health.status_code == 200
        assert local_port(health) == local_port(r)  # the same keep-alive connection


def test_a_valid_surrogate_pair_is_text(server: Server) -> None:
    """The check must not catch escaped non-BMP characters: the pair is one code point."""
    escaped = f'{{"model": "{TINY}", "prompt": "hi \\ud83d\\ude00"}}'.encode()
    raw = json.dumps({"model": TINY, "prompt": "hi \U0001f600"}, ensure_ascii=False).encode()
    a = httpx.post(f"{server.url}/tokenize", content=escaped, headers=AUTH, timeout=30)
    b = httpx.post(f"{server.url}/tokenize", content=raw, headers=AUTH, timeout=30)
    assert a.status_code == b.status_code == 200
    assert a.json()["tokens"] == b.json()["tokens"]
    assert len(a.json()["tokens"]) >= 2


@pytest.mark.parametrize(
    "value",
    [b"Bearer \xff", b"\xff\xfe", b"Bearer " + API_KEY.encode() + b"\xff", b"Bearer", b"Basic x"],
)
def test_malformed_authorization_is_401(server: Server, value: bytes) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.get("/v1/models", headers=[(b"Authorization", value)])
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        ok = client.get("/v1/models", headers=[(b"Authorization", f"Bearer {API_KEY}".encode())])
        assert ok.status_code == 200
        assert local_port(ok) == local_port(r)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ('"repetition_penalty": NaN', "repetition_penalty"),
        ('"temperature": Infinity', "temperature"),
        ('"presence_penalty": -Infinity', "presence_penalty"),
        ('"n": true', "n"),
        ('"max_tokens": 2.5', "max_tokens"),
        ('"top_k": "5"', "top_k"),
        ('"seed": 9223372036854775808', "seed"),
        ('"seed": 9223372036854775807, "n": 2, "stream": true', "seed"),  # choice 1: seed + 1
        ('"priority": -9223372036854775809', "priority"),
        ('"priority": false', "priority"),
        ('"stop_token_ids": [true]', "stop_token_ids"),
        ('"logprobs": true', "logprobs"),
    ],
)
def test_strict_fields_are_400(server: Server, extra: str, param: str) -> None:
    body = f'{{"model": "{TINY}", "prompt": "hi", "max_tokens": 1, {extra}}}'
    r = httpx.post(f"{server.url}/v1/completions", content=body.encode(), headers=AUTH, timeout=30)
    assert_400(r, param)


def test_int64_edges_are_accepted(server: Server) -> None:
    body = {"model": TINY, "prompt": [5], "max_tokens": 1, "seed": 2**63 - 2, "n": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    body = {**body, "seed": -(2**63), "top_k": 2**63 - 1}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_integral_floats_are_integers(server: Server) -> None:
    """JSON Schema's integers include 2.0 (the published document admits it): so does the
    server, as the very integer."""
    body = {"model": TINY, "prompt": [5, 9.0], "max_tokens": 3.0, "n": 2.0, "seed": 1e3}
    as_ints = {"model": TINY, "prompt": [5, 9], "max_tokens": 3, "n": 2, "seed": 1000}
    got = [
        httpx.post(f"{server.url}/v1/completions", json=b, headers=AUTH, timeout=60)
        for b in (body, as_ints)
    ]
    assert [r.status_code for r in got] == [200, 200], got[0].text
    texts = [[c["text"] for c in r.json()["choices"]] for r in got]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    assert got[0].json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("prompt", [[True, 1], [[1, 2], [True]], [1, 2.5]])
def test_booleans_and_floats_are_no_token_ids(server: Server, prompt: list[object]) -> None:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert_400(r, "prompt")


def test_detokenize_takes_integers_only(server: Server) -> None:
    url = f"{server.url}/detokenize"
    for tokens in ([True], [1.5], ["1"]):
        r = httpx.post(url, json={"model": TINY, "tokens": tokens}, headers=AUTH, timeout=30)
        assert_400(r, "tokens")
    ids = httpx.post(
        f"{server.url}/tokenize", json={"model": TINY, "prompt": "Hello world"}, headers=AUTH
    ).json()["tokens"]
    r = httpx.post(url, json={"model": TINY, "tokens": ids}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"].endswith("Hello world")


def test_priority_passes_through_to_the_engine(server: Server) -> None:
    url = f"{server.url}/v1/completions"
    body = {"model": TINY, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    r = httpx.post(url, json={**body, "priority": 0}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # The default policy (fcfs) refuses a priority it would ignore, as vLLM does.
    r = httpx.post(url, json={**body, "priority": -3}, headers=AUTH, timeout=60)
    assert "priority" in assert_400(r, None)
    chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "priority": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert "priority" in assert_400(r, None)


def test_n_above_the_cap_is_400(server: Server) -> None:
    completion = {"model": TINY, "prompt": [5], "max_tokens": 1, "n": 129}  # default --max-n 128
    r = httpx.post(f"{server.url}/v1/completions", json=completion, headers=AUTH, timeout=60)
    assert "(--max-n)" in assert_400(r, "n")
    chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "n": 1000}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert "(--max-n)" in assert_400(r, "n")
    r = httpx.post(
        f"{server.url}/v1/completions", json={**completion, "n": 128}, headers=AUTH, timeout=120
    )
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(128))


def test_too_many_prompts_is_400(server: Server) -> None:
    url = f"{server.url}/v1/completions"
    body = {"model": TINY, "prompt": [[5, i] for i in range(257)], "max_tokens": 1}
    r = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert "(--max-prompts-per-request)" in assert_400(r, "prompt")
    r = httpx.post(url, json={**body, "prompt": ["x"] * 300}, headers=AUTH, timeout=60)
    assert "300 prompts" in assert_400(r, "prompt")
    r = httpx.post(url, json={**body, "prompt": body["prompt"][:256]}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 256


def test_openapi_is_open_and_says_400_not_422(server: Server) -> None:
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)  # no API key
    assert r.status_code == 200
    doc = r.json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    # 408 and 431: the HTTP layer's (http_guard.py), on every route
    assert set(completions) == {
        "200", "400", "401", "404", "408", "413", "429", "431", "500", "503",
    }  # fmt: skip
    assert "422" not in json.dumps(doc)
    for path in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 404
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401


def test_n_beyond_the_queue_cap_is_429_even_when_idle(queue_server: Server) -> None:
    """``--max-queued-requests 2`` counts sequences: one request with n=3 never fits."""
    queue_server.wait_idle()
    body = {"model": BUILTIN, "prompt": "hi", "max_tokens": 1, "n": 3}
    r = httpx.post(f"{queue_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "--max-queued-requests" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(f"{queue_server.url}/v1/completions", json={**body, "n": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
