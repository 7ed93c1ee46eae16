"""Streaming clients for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Each request streams (``stream: true`` with ``stream_options.include_usage``) and is timed on
the client with ``time.perf_counter``:

* TTFT: from just before the POST to the arrival of the first chunk that carries generated
  text. Chunks without text (a chat ``role`` delta, an empty final chunk) are not tokens: a
  server that sends the role at once would otherwise report a TTFT of a few microseconds.
* ITL: the gap between consecutive text-carrying chunks; a chunk holding several tokens is one
  gap, as in vLLM, so ITL describes what a reader of the stream sees.
* E2E latency: from the POST to the last text-carrying chunk (vLLM's definition, which makes
  TPOT = (latency - TTFT) / (output_tokens - 1) the pure decode time).

Token counts come from the server's final ``usage`` chunk when present; otherwise the output is
counted with the benchmark's tokenizer, and without one by the number of text chunks; each
record says which source it used. ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens
the server's prefix cache served, OpenAI's field) is kept when the server sends it.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import aiohttp

_MAX_ERROR_BODY = 2000  # characters of an HTTP error body kept in the record


@dataclass
class RequestInput:
    """Everything one request function needs to send one request."""

    api_url: str
    model: str
    prompt: str
    prompt_len: int
    max_tokens: int
    chat_messages: list[dict[str, str]] | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None  # merged into the JSON body last (top_k, ...)
    headers: dict[str, str] | None = None  # Authorization and user headers
    expected_output_len: int | None = None


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds on the ``perf_counter`` clock."""

    success: bool = False
    error: str = ""
    http_status: int | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "none"  # "usage", "tokenizer" or "chunks"
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # when the POST was issued
    queue_time: float = 0.0  # waited for the client's concurrency cap before sending
    generated_text: str = ""
    expected_output_len: int | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent


TokenCounter = Callable[[str], int]
RequestFunc = Callable[[aiohttp.ClientSession, RequestInput], Awaitable[RequestRecord]]


class SSEDecoder:
    """Incremental decoder of a ``text/event-stream`` body into ``data`` payloads.

    Follows the SSE framing rules that matter here: events end at a blank line, several
    ``data:`` lines of one event are joined with newlines, lines starting with ``:`` are
    comments (keep-alive pings) and ``\\r\\n`` line endings are accepted.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        # Incremental: a multi-byte UTF-8 character may be split across two network reads.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes | str) -> Iterator[str]:
        """Add raw bytes; yield the data payload of every event completed by them."""
        self._buffer += self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        while True:
            cut = self._buffer.find("\n")
            if cut < 0:
                return
            line = self._buffer[:cut].rstrip("\r")
            self._buffer = self._buffer[cut + 1 :]
            payload = self._line(line)
            if payload is not None:
                yield payload

    def flush(self) -> Iterator[str]:
        """Yield a last event the stream ended without terminating (a lenient server)."""
        self._buffer += self._utf8.decode(b"", final=True)
        if self._buffer:
            payload = self._line(self._buffer.rstrip("\r"))
            self._buffer = ""
            if payload is not None:
                yield payload
        payload = self._line("")
        if payload is not None:
            yield payload

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            payload = "\n".join(self._data)
            self._data = []
            return payload
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def build_headers(api_key: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Bearer auth from ``api_key`` (else ``$OPENAI_API_KEY``) plus user headers."""
    headers = {"Content-Type": "application/json"}
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    headers.update(extra or {})
    return headers


def _streaming_body(body: dict[str, Any], inp: RequestInput) -> dict[str, Any]:
    """Add what both endpoints share: streaming with usage, ignore_eos, the user's extras."""
    body.update(stream=True, stream_options={"include_usage": True})
    if inp.ignore_eos:
        body["ignore_eos"] = True
    body.update(inp.extra_body or {})
    return body


def completions_payload(inp: RequestInput) -> dict[str, Any]:
    """JSON body for ``/v1/completions``."""
    body: dict[str, Any] = {
        "model": inp.model,
        "prompt": inp.prompt,
        "max_tokens": inp.max_tokens,
    }
    return _streaming_body(body, inp)


def chat_payload(inp: RequestInput) -> dict[str, Any]:
    """JSON body for ``/v1/chat/completions``.

    Both ``max_completion_tokens`` (the current OpenAI name, vLLM's benchmark sends it) and the
    older ``max_tokens`` are sent, so servers that know only one of them still get the cap.
    """
    messages = inp.chat_messages or [{"role": "user", "content": inp.prompt}]
    body: dict[str, Any] = {
        "model": inp.model,
        "messages": messages,
        "max_completion_tokens": inp.max_tokens,
        "max_tokens": inp.max_tokens,
    }
    return _streaming_body(body, inp)


def _chunk_text(choice: dict[str, Any]) -> str:
    """Generated text of one streamed choice, for both endpoint shapes."""
    if "delta" in choice:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class _StreamState:
    """Accumulates timings and counts while a stream is read."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.token_chunks = 0
        self.last_token_time = record.start_time
        self.parts: list[str] = []
        self.done = False
        self.usage: dict[str, Any] | None = None

    def on_payload(self, payload: str, now: float) -> None:
        """Handle one SSE data payload that arrived at ``now``."""
        if payload.strip() == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        if isinstance(data, dict) and data.get("error"):
            # Servers report mid-stream failures as a data event with an "error" object.
            err = data["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else err)
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for choice in data.get("choices") or []:
            text = _chunk_text(choice)
            finish = choice.get("finish_reason")
            if finish:
                self.record.finish_reason = finish
            # An empty chunk with a finish_reason is the first token only when nothing came
            # before it (the model emitted EOS at once); otherwise it carries no token.
            if text or (finish and self.token_chunks == 0):
                self._on_token(text, now)

    def _on_token(self, text: str, now: float) -> None:
        if self.token_chunks == 0:
            self.record.ttft = now - self.record.start_time
        else:
            self.record.itl.append(now - self.last_token_time)
        self.token_chunks += 1
        self.last_token_time = now
        self.parts.append(text)

    def finish(self, count_tokens: TokenCounter | None) -> None:
        """Fill the record's outcome, latency and token counts after the stream ended."""
        rec = self.record
        rec.generated_text = "".join(self.parts)
        rec.latency = self.last_token_time - rec.start_time
        if self.token_chunks == 0:
            rec.error = "the stream ended without any generated token."
            return
        if not (self.done or rec.finish_reason):
            rec.error = "the stream ended before [DONE] or a finish_reason (cut off)."
            return
        rec.success = True
        usage = self.usage or {}
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_len = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            rec.output_tokens, rec.output_tokens_source = usage["completion_tokens"], "usage"
        elif count_tokens is not None:
            rec.output_tokens = count_tokens(rec.generated_text)
            rec.output_tokens_source = "tokenizer"
        else:
            rec.output_tokens, rec.output_tokens_source = self.token_chunks, "chunks"


async def _stream_request(
    session: aiohttp.ClientSession,
    inp: RequestInput,
    body: dict[str, Any],
    count_tokens: TokenCounter | None,
) -> RequestRecord:
    record = RequestRecord(prompt_len=inp.prompt_len, expected_output_len=inp.expected_output_len)
    state = _StreamState(record)
    decoder = SSEDecoder()
    record.start_time = time.perf_counter()
    state.last_token_time = record.start_time
    try:
        async with session.post(inp.api_url, json=body, headers=inp.headers) as response:
            record.http_status = response.status
            if response.status != 200:
                text = await response.text(errors="replace")
                record.error = f"HTTP {response.status}: {text[:_MAX_ERROR_BODY]}"
                record.latency = time.perf_counter() - record.start_time
                return record
            async for raw in response.content.iter_any():
                now = time.perf_counter()  # one arrival time for all events in this read
                for payload in decoder.feed(raw):
                    state.on_payload(payload, now)
            for payload in decoder.flush():
                state.on_payload(payload, time.perf_counter())
        state.finish(count_tokens)
    except Exception as e:  # the record carries the failure; one bad request must not stop a run
        record.success = False
        record.error = f"{type(e).__name__}: {e}"
        record.generated_text = "".join(state.parts)
        record.latency = time.perf_counter() - record.start_time
    return record


async def request_completions(
    session: aiohttp.ClientSession, inp: RequestInput, count_tokens: TokenCounter | None = None
) -> RequestRecord:
    """Send one streaming ``/v1/completions`` request and time it."""
    return await _stream_request(session, inp, completions_payload(inp), count_tokens)


async def request_chat(
    session: aiohttp.ClientSession, inp: RequestInput, count_tokens: TokenCounter | None = None
) -> RequestRecord:
    """Send one streaming ``/v1/chat/completions`` request and time it."""
    return await _stream_request(session, inp, chat_payload(inp), count_tokens)


async def request_grpc(
    conn: Any, inp: RequestInput, count_tokens: TokenCounter | None = None
) -> RequestRecord:
    """Send one streaming gRPC ``GenerateStream`` call (kvserve's ``--grpc-port``) and time it;
    ``conn`` is what ``open_transport`` gives for the ``grpc`` backend."""
    from kvserve.bench import grpc_client  # imports this module: loaded on first use

    return await grpc_client.request_grpc(conn, inp, count_tokens)


# Backend names of `vllm bench serve --backend` that this client speaks, and kvserve's gRPC.
BACKENDS: dict[str, Callable[..., Awaitable[RequestRecord]]] = {
    "openai": request_completions,
    "vllm": request_completions,
    "openai-chat": request_chat,
    "grpc": request_grpc,
}
DEFAULT_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}


async def fetch_model_ids(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """The model ids the server lists at ``/v1/models``."""
    async with session.get(f"{base_url}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models returned HTTP {response.status}.")
        data = await response.json()
    return [str(m["id"]) for m in data.get("data") or []]


async def choose_model_name(
    session: aiohttp.ClientSession, base_url: str, model: str | None, served_name: str | None
) -> str:
    """The name to send in requests.

    ``served_name`` wins; otherwise ``model`` when the server lists it, or the folder/file name
    of a ``model`` path (kvserve serves ``/models/llama`` as ``llama``); without ``model`` the
    server's first model. When ``/v1/models`` cannot be read, ``model`` is sent as given.
    """
    if served_name:
        return served_name
    try:
        ids = await fetch_model_ids(session, base_url)
    except (aiohttp.ClientError, RuntimeError, ValueError, KeyError, TypeError):
        if model is None:
            raise
        return model
    if model is None:
        if not ids:
            raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model.")
        return ids[0]
    stem = PurePath(model.rstrip("/")).stem if model.endswith(".gguf") else None
    for candidate in (model, PurePath(model.rstrip("/")).name, stem):
        if candidate in ids:
            return candidate
    return model


@contextlib.asynccontextmanager
async def open_transport(
    backend: str, session: aiohttp.ClientSession, api_url: str, timeout_s: float
) -> AsyncIterator[Any]:
    """What ``BACKENDS[backend]`` takes first: the HTTP session, or for ``grpc`` a channel to
    ``api_url`` (``host:port``), open for the whole run."""
    if backend != "grpc":
        yield session
        return
    from kvserve.bench import grpc_client

    async with grpc_client.open_connection(api_url, timeout_s) as conn:
        yield conn


def make_session(timeout_s: float) -> aiohttp.ClientSession:
    """One shared session with an unlimited connection pool: aiohttp's default pool (100)
    would silently queue requests inside the client and inflate TTFT; the concurrency cap is
    the runner's semaphore, where waiting is measured as queue time."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    )
