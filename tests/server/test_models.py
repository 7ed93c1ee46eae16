"""Model listing, routing between two served models, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import BUILTIN, TINY, Server

pytestmark = pytest.mark.slow


def test_models_list_and_retrieve(server: Server) -> None:
    client = server.client()
    ids = [m.id for m in client.models.list()]
    assert ids == [BUILTIN, TINY]
    m = client.models.retrieve(TINY)
    assert m.id == TINY and m.object == "model" and m.owned_by == "kvserve"
    assert m.model_extra["max_model_len"] == 1024


def test_requests_route_by_model_name(server: Server) -> None:
    client = server.client()
    before = server.metrics(TINY)["kvserve:generation_tokens_total"]
    kw = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
    tiny = client.completions.create(model=TINY, **kw)  # type: ignore[call-overload]
    real = client.completions.create(model=BUILTIN, **kw)  # type: ignore[call-overload]
    assert tiny.model == TINY and real.model == BUILTIN
    assert tiny.choices[0].model_extra["token_ids"] != real.choices[0].model_extra["token_ids"]
    assert server.metrics(TINY)["kvserve:generation_tokens_total"] - before == 6
    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.model == TINY
    # The tiny model's context is 1024 tokens: its own limit applies, not the other model's.
    r = httpx.post(
        f"{server.url}/v1/completions", headers=server.headers(),
        json={"model": TINY, "prompt": [5] * 1000, "max_tokens": 100},
    )  # fmt: skip
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]


@pytest.mark.parametrize("model", [BUILTIN, TINY])
def test_tokenize_detokenize_round_trip(server: Server, model: str) -> None:
    h = server.headers()
    text = "Hello world, this is kvserve!"
    tok = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": text}, headers=h)
    body = tok.json()
    assert body["count"] == len(body["tokens"]) > 3
    assert body["max_model_len"] == (8192 if model == BUILTIN else 1024)
    detok = httpx.post(
        f"{server.url}/detokenize", json={"model": model, "tokens": body["tokens"]}, headers=h
    )
    assert detok.json() == {"prompt": text}
    msgs = {"model": model, "messages": [{"role": "user", "content": text}]}
    chat = httpx.post(f"{server.url}/tokenize", json=msgs, headers=h).json()
    assert chat["count"] > body["count"]  # the template adds the role markers
    bad = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": [-1]}, headers=h)
    assert bad.status_code == 400
    missing = httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"}, headers=h)
    assert missing.status_code == 404
