"""Prefix caching over HTTP: cached_tokens in usage (official client), the Prometheus
counters, and POST /reset_prefix_cache."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TINY, Server

pytestmark = pytest.mark.slow


def reset(server: Server, model: str | None = TINY) -> httpx.Response:
    params = {"model": model} if model else None
    return httpx.post(
        f"{server.url}/reset_prefix_cache", params=params, headers=server.headers(), timeout=30
    )


def counters(server: Server) -> tuple[float, float]:
    m = server.metrics(TINY)
    return m["kvserve:prefix_cache_queries_total"], m["kvserve:prefix_cache_hits_total"]


def test_cached_tokens_in_usage_and_metrics(server: Server) -> None:
    server.wait_idle(TINY)
    r = reset(server)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert set(r.json()["num_blocks_dropped"]) == {TINY}
    client = server.client()
    q0, h0 = counters(server)
    first = client.chat.completions.create(
        model=TINY, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The chat template's system prompt (and the role markers) are shared: whole 16-token
    # blocks of it are found, never the last prompt token.
    second = client.chat.completions.create(
        model=TINY, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Tell me a joke."}],
    )  # fmt: skip
    usage = [c.usage for c in second if c.usage is not None][-1]
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < usage.prompt_tokens
    q1, h1 = counters(server)
    assert h1 - h0 == cached
    assert q1 - q0 == first.usage.prompt_tokens + usage.prompt_tokens
    # The same completion prompt again: everything but its last block is found.
    prompt = "Once upon a time " * 12
    body = {"model": TINY, "prompt": prompt, "max_tokens": 2}
    a = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
    b = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
    n = a.json()["usage"]["prompt_tokens"]
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == ((n - 1) // 16) * 16
    # After a reset nothing is found.
    assert reset(server, None).json()["num_blocks_dropped"][TINY] > 0
    c = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
    assert c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_reset_needs_the_key_and_a_known_model(server: Server) -> None:
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=10).status_code == 401
    r = reset(server, "no-such-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
