"""Issue 11's reproducers against real servers: bad requests get their own answer, a
concurrent innocent stream gets exactly the tokens it gets alone, and /health stays 200; and
priority scheduling over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, TINY, Server, start_server

pytestmark = pytest.mark.slow

INNOCENT = {
    "model": TINY, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
    "ignore_eos": True, "stream": True, "return_token_ids": True,
}  # fmt: skip
# The reproducers; the first passed validation and killed the engine in 3 requests.
HUGE_TOP_K = {"model": TINY, "prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808}
BAD_STOP_ID = {
    "model": TINY, "prompt": "hi", "max_tokens": 4, "min_tokens": 2,
    "stop_token_ids": [999999999],
}  # fmt: skip


async def stream_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
    """The token ids of a streamed completion (``return_token_ids``), checked to end cleanly."""
    ids: list[int] = []
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            ids += c.get("token_ids") or []
    return ids


async def run_beside(server: Server, bad: dict[str, Any], times: int) -> tuple[list[int], list]:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as c:
        innocent = asyncio.create_task(stream_tokens(c, INNOCENT))
        await asyncio.sleep(0.05)
        answers = [await c.post("/v1/completions", json=bad) for _ in range(times)]
        return await innocent, answers


def test_reproducers_hurt_nobody(server: Server) -> None:
    alone = asyncio.run(run_beside(server, {"model": TINY, "prompt": "x", "max_tokens": 1}, 1))[0]
    assert len(alone) == 24
    tokens, answers = asyncio.run(run_beside(server, HUGE_TOP_K, 3))
    assert tokens == alone
    assert [a.status_code for a in answers] == [400, 400, 400]  # not an int64
    assert answers[0].json()["error"]["param"] == "top_k"
    # An int64 top_k beyond the vocabulary keeps every token: honoured (vLLM clamps it too).
    tokens, answers = asyncio.run(run_beside(server, {**HUGE_TOP_K, "top_k": 2**63 - 1}, 3))
    assert tokens == alone
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
    tokens, answers = asyncio.run(run_beside(server, BAD_STOP_ID, 3))
    assert tokens == alone
    assert [a.status_code for a in answers] == [400, 400, 400]
    err = answers[0].json()["error"]
    assert "stop_token_ids" in err["message"] and "out of the vocabulary" in err["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_priority_needs_the_priority_policy(server: Server) -> None:
    body = {"model": TINY, "prompt": "hi", "max_tokens": 2, "priority": -5}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
    assert r.status_code == 400
    assert "priority scheduling is not enabled" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def priority_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One running sequence at a time, admitted by priority."""
    log = tmp_path_factory.mktemp("logs") / "priority_server.log"
    args = [
        str(tiny_model_dir), "--served-model-name", TINY, "--max-num-seqs", "1",
        "--num-kv-blocks", "200", "--scheduling-policy", "priority",
    ]  # fmt: skip
    srv = start_server(args, log, api_key=API_KEY)
    yield srv
    srv.stop()


async def first_token_time(client: httpx.AsyncClient, priority: int, max_tokens: int) -> float:
    body = {
        "model": TINY, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "priority": priority,
    }  # fmt: skip
    first = 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and not first:
                first = time.monotonic()
    return first


def test_high_priority_goes_first_in_a_saturated_server(priority_server: Server) -> None:
    async def until(metric: str, n: int) -> None:
        """Poll /metrics until ``metric`` is n (no sleep-based timing: on a fast machine the
        long request ended before a fixed delay sent the others)."""
        for _ in range(1000):
            m = await asyncio.to_thread(priority_server.metrics, TINY)
            if m.get(f"kvserve:{metric}") == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never saw {metric} == {n}")

    async def scenario() -> tuple[float, list[float], float]:
        async with httpx.AsyncClient(
            base_url=priority_server.url, headers=priority_server.headers(), timeout=120
        ) as c:
            # fills the batch (max_num_seqs 1) for 1000 steps
            running = asyncio.create_task(first_token_time(c, 10, 1000))
            await until("num_requests_running", 1)
            queued = [asyncio.create_task(first_token_time(c, 10, 20)) for _ in range(3)]
            await until("num_requests_waiting", 3)
            high = await first_token_time(c, 0, 4)
            return high, list(await asyncio.gather(*queued)), await running

    high, queued, running = asyncio.run(scenario())
    assert running < high  # the long request was running first
    assert all(high < q for q in queued), (high, queued)
    m = priority_server.metrics(TINY)
    assert m["kvserve:num_preemptions_total"] >= 1  # the high one preempted the running one
