"""The attacks of ``benchmarks/adversarial_soak.py`` (issue 28's reproducers), each bounded in
bytes, connections and time, each returning ``Probe`` records: what was sent, what came back
and whether that is the answer the server owes it."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

MODEL_NAME = "soak"  # the served name (overload_soak.py's, so its workload can be reused)
COMPLETIONS, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"


@dataclass(frozen=True)
class Probe:
    """One attack request (or connection) and how the server answered it."""

    name: str
    ok: bool  # the answer the server owes it (a 400 naming a flag, a cut connection, ...)
    status: int | None  # the HTTP status, None where none came (a closed connection)
    seconds: float
    detail: str = ""
    conn_cap_503: bool = False  # a 503 from --max-connections (documented), not a failure


def names_a_flag(status: int, text: str) -> bool:
    """A 400 whose message names the flag that raises the limit (``--max-...``)."""
    return status == 400 and "--max-" in text


# -- requests that must be refused cheaply ------------------------------------------------------
def tools_body(num_tools: int) -> dict[str, Any]:
    """The 10,000-tools ``tool_choice: "required"`` request of the issue (~750 KB)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(num_tools)]  # fmt: skip
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "tool_choice": "required", "tools": tools}  # fmt: skip


def enum_body(members: int) -> dict[str, Any]:
    """A JSON schema with one ``members``-member enum (integers keep it under 1 MiB)."""
    schema = {"type": "object", "properties": {"x": {"enum": list(range(members))}}}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "pick"}],
            "max_tokens": 8, "response_format": {"type": "json_schema",
            "json_schema": {"name": "e", "schema": schema}}}  # fmt: skip


async def post(
    session: aiohttp.ClientSession, base: str, path: str, body: dict[str, Any] | bytes
) -> tuple[int, bytes, float]:
    data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    t0 = time.perf_counter()
    async with session.post(
        base + path, data=data, headers={"Content-Type": "application/json"}
    ) as r:
        payload = await r.read()
        return r.status, payload, time.perf_counter() - t0


async def expect(
    session: aiohttp.ClientSession, base: str, name: str, path: str,
    body: dict[str, Any] | bytes, want: int, flag: bool = False,
) -> Probe:  # fmt: skip
    """Send one request; ok if it gets ``want`` (and, with ``flag``, a message naming one)."""
    try:
        status, payload, secs = await post(session, base, path, body)
    except (aiohttp.ClientError, TimeoutError) as e:
        return Probe(name, False, None, 0.0, f"{type(e).__name__}: {e}")
    text = payload[:300].decode(errors="replace")
    ok = status == want and (not flag or names_a_flag(status, payload.decode(errors="replace")))
    detail = text if status != 200 else f"{len(payload)} bytes answered"
    return Probe(name, ok, status, secs, detail, status == 503)


def limit_probes(long_prompt: str) -> list[tuple[str, str, dict[str, Any], int, bool]]:
    """(name, path, body, status owed, must name a flag) of the small costly requests."""
    m = MODEL_NAME
    return [
        ("tools_10k_required", CHAT, tools_body(10_000), 400, True),
        ("enum_100k", CHAT, enum_body(100_000), 400, True),  # its bytes are over first
        ("enum_2k", CHAT, enum_body(2_000), 400, True),  # 12 KB: its members are over
        ("prompts_x_n_over", COMPLETIONS, {"model": m, "prompt": ["a", "b", "c"], "n": 100,
                                           "max_tokens": 1}, 400, True),
        ("prompt_logprobs_21", COMPLETIONS, {"model": m, "prompt": "hi", "max_tokens": 1,
                                             "prompt_logprobs": 21}, 400, True),
        ("prompt_logprobs_20_long", COMPLETIONS, {"model": m, "prompt": long_prompt,
                                                  "max_tokens": 1, "prompt_logprobs": 20}, 200,
         False),
        ("echo_logprobs_20_long", COMPLETIONS, {"model": m, "prompt": long_prompt,
                                                "max_tokens": 1, "echo": True, "logprobs": 20},
         200, False),
    ]  # fmt: skip


async def n_stream(session: aiohttp.ClientSession, base: str, n: int) -> Probe:
    """A chat stream with ``n`` choices: every index must end with ``[DONE]``."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
            "n": n, "max_tokens": 8, "stream": True, "temperature": 1.0, "seed": 1}  # fmt: skip
    t0, seen = time.perf_counter(), set[int]()
    try:
        async with session.post(base + CHAT, json=body) as r:
            if r.status != 200:
                text = (await r.read())[:300].decode(errors="replace")
                return Probe(f"n{n}_chat_stream", False, r.status, time.perf_counter() - t0, text)
            async for raw in r.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    ok = seen == set(range(n))
                    return Probe(f"n{n}_chat_stream", ok, 200, time.perf_counter() - t0,
                                 f"{len(seen)} choices")  # fmt: skip
                if line.startswith(b"data: "):
                    seen.update(c["index"] for c in json.loads(line[6:]).get("choices") or [])
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return Probe(f"n{n}_chat_stream", False, None, time.perf_counter() - t0, repr(e))
    return Probe(f"n{n}_chat_stream", False, 200, time.perf_counter() - t0, "no [DONE]")


# -- large conversations -----------------------------------------------------------------------
def big_text(lines: list[str], nbytes: int) -> str:
    """About ``nbytes`` of plain ASCII prose (nothing JSON must escape), from ``lines``."""
    usable = [ln for ln in lines if ln.isascii() and '"' not in ln and "\\" not in ln]
    parts, size, i = [], 0, 0
    while size <= nbytes:  # size counts a separator after each part, one more than join
        parts.append(usable[i % len(usable)])
        size += len(parts[-1]) + 1
        i += 1
    return " ".join(parts)[:nbytes]


async def big_chats(
    session: aiohttp.ClientSession, base: str, text: str, count: int, tokenizes: int
) -> list[Probe]:
    """``count`` concurrent single-message chats and ``tokenizes`` /tokenize calls of ``text``.

    With the defaults a 1,000,000-byte message is under --max-chat-bytes (1 MiB) and the body
    under --max-request-body-bytes (1 MiB): it is templated and tokenized (off the event loop),
    then refused as longer than the context (400); /tokenize answers its tokens (200).
    """
    msgs = [{"role": "user", "content": text}]
    chat = {"model": MODEL_NAME, "messages": msgs, "max_tokens": 4}
    tok = {"model": MODEL_NAME, "messages": msgs}
    jobs = [expect(session, base, "chat_1mb", CHAT, chat, 400) for _ in range(count)]
    jobs += [expect(session, base, "tokenize_1mb", TOKENIZE, tok, 200) for _ in range(tokenizes)]
    over = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text + text[:100_000]}]}
    jobs.append(expect(session, base, "chat_over_body_limit", CHAT, over, 413))
    return list(await asyncio.gather(*jobs))


# -- the HTTP layer ----------------------------------------------------------------------------
def _status(data: bytes) -> int | None:
    """The status of an HTTP/1.1 answer's first line, if one came."""
    parts = data.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") else None


def header_flood(host: str, port: int, total: int, key: str | None, limit_s: float) -> Probe:
    """Offer ``total`` bytes of one header (blocking; run in a thread); stop when the server
    answers or closes. ok if it did so before taking everything."""
    name = "header_flood_" + ("key" if key else "no_key")
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = f"POST {CHAT} HTTP/1.1\r\nHost: soak\r\n{auth}X-Flood: ".encode()
    chunk, sent, end, status = b"a" * (1 << 16), 0, "all sent", None
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=5) as s:
        try:
            s.sendall(head)
            while sent < total and time.perf_counter() - t0 < limit_s:
                if select.select([s], [], [], 0)[0]:
                    status, end = _status(s.recv(4096)), "answered"
                    break
                s.sendall(chunk)
                sent += len(chunk)
            else:
                end = "all sent" if sent >= total else "time limit"
        except (BrokenPipeError, ConnectionResetError):
            end = "closed by the server"
        except TimeoutError:
            end = "stalled: the server stopped reading without closing"
        if status is None and end != "stalled: the server stopped reading without closing":
            try:
                s.settimeout(2)
                status = _status(s.recv(4096))
            except OSError:
                pass
    ok = end in ("answered", "closed by the server") and sent < total
    detail = f"{end} after {sent / (1 << 20):.1f} MiB of {total / (1 << 20):.0f} MiB"
    return Probe(name, ok, status, time.perf_counter() - t0, detail, status == 503)


def header_count(host: str, port: int, count: int, key: str) -> Probe:
    """A request with ``count`` small headers: 431 (--max-header-count / --max-header-bytes)."""
    lines = "".join(f"X-H{i}: v\r\n" for i in range(count))
    req = f"GET /v1/models HTTP/1.1\r\nHost: soak\r\nAuthorization: Bearer {key}\r\n{lines}\r\n"
    t0, status, detail = time.perf_counter(), None, ""
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            s.sendall(req.encode())
            status = _status(s.recv(4096))
        except OSError as e:
            detail = f"{type(e).__name__} (closed before an answer)"
    return Probe("many_headers", status == 431, status, time.perf_counter() - t0, detail,
                 status == 503)  # fmt: skip


async def _slow_head(host: str, port: int, limit_s: float) -> Probe:
    """A half-sent request that trickles a header a second until the server gives up."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        return Probe("slowloris", False, None, 0.0, f"connect: {e!r}")
    status, end = None, "still open at the time limit"
    try:
        writer.write(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: soak\r\n".encode())
        while time.perf_counter() - t0 < limit_s:
            try:
                data = await asyncio.wait_for(reader.read(4096), 1.0)
            except TimeoutError:
                writer.write(b"X-Slow: 1\r\n")  # one more header line, never the blank one
                await writer.drain()
                continue
            status, end = _status(data), "answered" if data else "closed"
            break
    except (ConnectionResetError, BrokenPipeError):
        end = "reset"
    finally:
        writer.close()
    secs = time.perf_counter() - t0
    ok = end != "still open at the time limit"
    return Probe("slowloris", ok, status, secs, end, status == 503)


async def slowloris(host: str, port: int, count: int, limit_s: float) -> list[Probe]:
    """``count`` half-sent requests, opened over about a second, each held up to ``limit_s``."""

    async def one(i: int) -> Probe:
        await asyncio.sleep(i / max(count, 1))
        return await _slow_head(host, port, limit_s)

    return list(await asyncio.gather(*(one(i) for i in range(count))))
