"""Concurrency, batching and disconnects, checked through /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import BUILTIN, Server

pytestmark = pytest.mark.slow

LONG = 2000  # tokens a request would take minutes to generate: it can only end by abort


async def test_32_concurrent_streams_run_in_batches(server: Server) -> None:
    before = server.wait_idle()
    client = server.async_client(max_retries=0)

    async def one(i: int) -> tuple[str | None, int, int]:
        stream = await client.completions.create(
            model=BUILTIN, prompt=f"Fact number {i} about the sea:", max_tokens=8,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        reason, used, prompt = None, 0, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                used, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        return reason, used, prompt

    results = await asyncio.gather(*(one(i) for i in range(32)))
    await client.close()
    assert [r[:2] for r in results] == [("length", 8)] * 32
    after = server.wait_idle()
    # Usage reports exactly what the engine counted.
    prompt_total = after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"]
    assert prompt_total == sum(r[2] for r in results)
    assert after["kvserve:max_num_requests_running"] > 1  # they shared steps
    assert (
        after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 256
    )
    assert (
        after["kvserve:request_success_total{length}"]
        - before.get("kvserve:request_success_total{length}", 0)
        == 32
    )
    assert after["kvserve:e2e_request_latency_seconds_count"] >= 32
    assert after["kvserve:time_to_first_token_seconds_count"] >= 32


def test_streaming_client_disconnect_frees_blocks(server: Server) -> None:
    before = server.wait_idle()
    body = {"model": BUILTIN, "prompt": "Tell me everything.", "max_tokens": LONG,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=30
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        while got < 3:
            if next(lines).startswith("data: "):
                got += 1
        busy = server.metrics()
        assert busy["kvserve:num_requests_running"] == 1
        assert busy["kvserve:kv_cache_usage_perc"] > 0
    # The connection is closed: the server must abort the request and free its blocks.
    after = server.wait_idle(timeout=10)
    assert (
        after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < LONG
    )


def test_non_streaming_client_disconnect_frees_blocks(server: Server) -> None:
    before = server.wait_idle()
    body = {"model": BUILTIN, "prompt": "Tell me everything.", "max_tokens": LONG,
            "ignore_eos": True}  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=2)
    assert server.metrics()["kvserve:num_requests_running"] in (0, 1)
    after = server.wait_idle(timeout=10)
    assert time.monotonic() - t0 < 15
    assert (
        after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < LONG
    )
