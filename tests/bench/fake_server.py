"""A fake OpenAI-compatible streaming server for the benchmark-lab tests (aiohttp only).

Used in-process by the client/serve tests and as a subprocess by the sweep test
(``python fake_server.py --port N``). It streams known pieces of text with known pauses,
a final ``usage`` chunk and ``[DONE]``, and exposes kvserve-style (or vLLM-style) Prometheus
metrics, including prefix-cache counters that grow by a known amount per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeServer:
    """What the fake server saw and how it answers."""

    base_url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    # Streamed pieces of text and the pause (s) before each; the usage chunk comes last.
    pieces: list[str] = field(default_factory=lambda: ["Hello", " big", " world"])
    delays: list[float] = field(default_factory=lambda: [0.2, 0.1, 0.1])
    usage: dict[str, int] | None = field(
        default_factory=lambda: {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    )
    fail_status: int | None = None  # answer every request with this HTTP status
    cut_after: int | None = None  # close the stream after this many pieces (no [DONE])
    preemptions_per_request: int = 0  # added to kvserve:num_preemptions_total per request
    # Added to {prefix}:prefix_cache_{queries,hits}_total per request (tokens); exported only
    # when queries_per_request is set, like a server without the counters otherwise.
    cache_queries_per_request: int | None = None
    cache_hits_per_request: int = 0
    cached_tokens: int | None = None  # sent as usage.prompt_tokens_details.cached_tokens
    metric_prefix: str = "kvserve"  # "vllm" exports vLLM's names
    unique_answers: bool = False  # answer request i with "ans", "-i", "." (i from 0)
    fail_requests: set[int] = field(default_factory=set)  # request numbers answered with 500
    answers: list[str] = field(default_factory=list)  # full text sent to each request, in order
    in_flight: int = 0
    served: int = 0


def _chunk(kind: str, text: str, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": "x", "object": "chunk", "choices": [choice], "usage": None}


async def _write(resp: web.StreamResponse, data: Any) -> None:
    await resp.write(f"data: {json.dumps(data)}\n\n".encode())


async def _stream(state: FakeServer, request: web.Request, kind: str) -> web.StreamResponse:
    number = len(state.bodies)
    state.bodies.append(await request.json())
    state.headers.append(dict(request.headers))
    if state.fail_status is not None or number in state.fail_requests:
        status = state.fail_status or 500
        return web.Response(status=status, text="engine exploded: out of blocks")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if kind == "chat":  # a role-only delta at once, which must not count as a token
        await _write(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    pieces = ["ans", f"-{number}", "."] if state.unique_answers else state.pieces
    state.answers.append("".join(pieces))
    last = len(pieces) - 1
    for i, (text, delay) in enumerate(zip(pieces, state.delays, strict=True)):
        if state.cut_after is not None and i >= state.cut_after:
            return resp
        await asyncio.sleep(delay)
        await _write(resp, _chunk(kind, text, "length" if i == last else None))
    if state.usage is not None:
        usage: dict[str, Any] = dict(state.usage)
        if state.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": state.cached_tokens}
        await _write(resp, {"id": "x", "choices": [], "usage": usage})
    await resp.write(b"data: [DONE]\n\n")
    return resp


def metrics_text(state: FakeServer) -> str:
    """The /metrics exposition: counters that grow per request served, gauges of now."""
    p = state.metric_prefix
    text = (
        f"# TYPE {p}:num_preemptions counter\n"
        f"{p}:num_preemptions_total {state.served * state.preemptions_per_request}\n"
        f"# TYPE {p}:num_requests_running gauge\n"
        f"{p}:num_requests_running {state.in_flight}\n"
        f"# TYPE {p}:num_requests_waiting gauge\n"
        f"{p}:num_requests_waiting 0\n"
    )
    if state.cache_queries_per_request is not None:
        text += (
            f"# TYPE {p}:prefix_cache_queries counter\n"
            f"{p}:prefix_cache_queries_total {state.served * state.cache_queries_per_request}\n"
            f"# TYPE {p}:prefix_cache_hits counter\n"
            f"{p}:prefix_cache_hits_total {state.served * state.cache_hits_per_request}\n"
        )
    return text


def make_app(state: FakeServer) -> web.Application:
    """The aiohttp app serving ``state``."""

    async def tracked(request: web.Request, kind: str) -> web.StreamResponse:
        # Counted on arrival, so a /metrics scrape after the client saw [DONE] includes it.
        state.in_flight += 1
        state.served += 1
        try:
            return await _stream(state, request, kind)
        finally:
            state.in_flight -= 1

    async def completions(request: web.Request) -> web.StreamResponse:
        return await tracked(request, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await tracked(request, "chat")

    async def models_list(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics_text(state), content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models_list)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.01)
    parser.add_argument("--preemptions-per-request", type=int, default=0)
    parser.add_argument("--cache-queries-per-request", type=int, default=None)
    parser.add_argument("--cache-hits-per-request", type=int, default=0)
    parser.add_argument("--metric-prefix", default="kvserve")
    args = parser.parse_args()
    state = FakeServer(
        delays=[args.delay] * 3,
        preemptions_per_request=args.preemptions_per_request,
        cache_queries_per_request=args.cache_queries_per_request,
        cache_hits_per_request=args.cache_hits_per_request,
        metric_prefix=args.metric_prefix,
    )
    web.run_app(make_app(state), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
