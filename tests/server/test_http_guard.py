"""The guarded HTTP layer against a live ``kvserve serve`` (kvserve/server/http_guard.py).

Raw sockets where the test is about bytes on the wire (huge or half-sent heads), httpx and the
``openai`` client for the innocent requests beside them. The server gets a small
``--max-connections`` and short timeouts so that the attacks are cheap and the test is fast.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve.ops.malloc_tuning import IDLE_TRIM_SECONDS
from kvserve.server.app import ServerState, build_app
from kvserve.server.cli import add_serve_parser
from kvserve.server.http_guard import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADER_COUNT,
    HttpLimits,
    cors_from_args,
    http_limits_from_args,
)
from kvserve.server.serving import Limits
from tests.server.conftest import API_KEY, TINY, Server, start_server

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 50
HEADER_TIMEOUT = 4.0  # seconds; long enough to count evictions before any head times out
BODY_TIMEOUT = 6.0  # seconds
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def guard_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "guard_server.log"
    srv = start_server(
        [
            str(tiny_model_dir), "--served-model-name", TINY,
            "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-tokens-limit", "8",
            "--scheduling-policy", "priority",  # any int64 priority is a valid request
            "--max-connections", str(MAX_CONNECTIONS),
            "--header-read-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout", "2",
            "--body-read-timeout", str(BODY_TIMEOUT),
            "--allowed-origins", json.dumps([ORIGIN]),  # vLLM's JSON form
        ],
        log,
        api_key=API_KEY,
    )  # fmt: skip
    yield srv
    srv.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sends before it closes (a reset ends it too)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def innocent_is_served(server: Server) -> None:
    client = server.client(max_retries=0, timeout=60)
    done = client.completions.create(model=TINY, prompt="Hello", max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# -- huge heads ---------------------------------------------------------------------------------
def test_huge_headers_are_cut_off_and_not_kept(guard_server: Server) -> None:
    """64 MiB of one header (the issue sent 1 GB): the server stops reading at
    --max-header-bytes, so the sender is cut off after a few socket buffers' worth."""
    pid = guard_server.proc.pid
    innocent_is_served(guard_server)  # its one-time allocations (pools, caches) come first
    # Both readings after the engine's idle heap trim: freed activations of the innocent
    # request otherwise stay in the heap for a while (37.7 MiB once, under load), and the
    # check is about the header's bytes, not the heap's timing.
    time.sleep(IDLE_TRIM_SECONDS + 1.5)
    before = rss_bytes(pid)
    sock = connect(guard_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    chunk, sent = b"a" * 65536, 0
    try:
        while sent < 64 * MiB:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    answer = read_until_closed(sock)
    sock.close()
    # a reset (the server closed with unread bytes) may swallow the 431; the cut is what counts
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert sent < 16 * MiB, f"the server read {sent} bytes of one header"
    innocent_is_served(guard_server)
    time.sleep(IDLE_TRIM_SECONDS + 1.5)
    assert rss_bytes(pid) - before < 32 * MiB


def test_a_head_over_the_byte_limit_gets_431(guard_server: Server) -> None:
    # The whole oversized head at once, then read: the server has read every byte, so its
    # close is clean and the 431 arrives.
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * DEFAULT_MAX_HEADER_BYTES
    for attempt in range(3):  # noqa: B007 (reported below)  a reset can race the answer on a busy machine: retry
        sock = connect(guard_server)
        sock.sendall(head + b"\r\n\r\n")
        answer = read_until_closed(sock)
        sock.close()
        if answer:
            break
    assert answer.startswith(b"HTTP/1.1 431 "), (attempt, answer[:200])
    assert b"--max-header-bytes" in answer
    # just under the limit is an ordinary request
    ok = "a" * (DEFAULT_MAX_HEADER_BYTES - 200)
    assert httpx.get(f"{guard_server.url}/health", headers={"X-Big": ok}).status_code == 200


def test_too_many_headers_get_431(guard_server: Server) -> None:
    many = [(f"x-h{i}", "1") for i in range(DEFAULT_MAX_HEADER_COUNT + 1)]
    r = httpx.post(f"{guard_server.url}/v1/models", headers=many, timeout=10)
    assert r.status_code == 431
    assert r.json()["error"]["code"] == 431
    assert "--max-header-count" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"
    few = many[: DEFAULT_MAX_HEADER_COUNT - 10] + list(AUTH.items())
    assert httpx.get(f"{guard_server.url}/v1/models", headers=few, timeout=10).status_code == 200


# -- slow and many connections ------------------------------------------------------------------
def closed_now(sock: socket.socket) -> bool:
    """The server has closed or answered (readable); without waiting."""
    poller = select.poll()  # not select(): it refuses descriptors above 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def test_slow_heads_beyond_the_cap_are_cut_and_an_innocent_client_is_served(
    guard_server: Server,
) -> None:
    """Four times --max-connections half-sent requests (a slowloris): the oldest idle ones
    are closed to make room, the rest after --header-read-timeout, and a client arriving in
    the middle of it is served at once."""
    time.sleep(2.5)  # --keep-alive-timeout: earlier tests' connections are gone
    slow = []
    started = time.monotonic()
    for _ in range(4 * MAX_CONNECTIONS):
        sock = connect(guard_server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: ")
        slow.append(sock)
    deadline = time.monotonic() + 2.0
    while sum(map(closed_now, slow)) < 3 * MAX_CONNECTIONS and time.monotonic() < deadline:
        time.sleep(0.05)
    evicted = [closed_now(s) for s in slow]
    assert time.monotonic() - started < HEADER_TIMEOUT, "too slow to tell eviction from timeout"
    # exactly the oldest 150 were closed, without a word: the newest 50 are still open
    assert evicted == [True] * (3 * MAX_CONNECTIONS) + [False] * MAX_CONNECTIONS
    assert all(read_until_closed(s, 1) == b"" for s in slow[: 3 * MAX_CONNECTIONS])

    innocent_is_served(guard_server)  # takes the place of the oldest slow ones

    for sock in slow[3 * MAX_CONNECTIONS :]:  # the rest: cut by the header timeout
        answer = read_until_closed(sock, HEADER_TIMEOUT + 10)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    for sock in slow:
        sock.close()
    assert time.monotonic() - started < 4 * HEADER_TIMEOUT + 30


def test_a_half_sent_head_gets_408_after_the_timeout(guard_server: Server) -> None:
    sock = connect(guard_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    answer = read_until_closed(sock, HEADER_TIMEOUT + 20)
    waited = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"--header-read-timeout" in answer
    assert waited > HEADER_TIMEOUT - 0.5  # cut by the timer, not by anything sooner


def test_connections_with_requests_in_flight_are_not_evicted(guard_server: Server) -> None:
    """--max-connections requests whose bodies never come hold every slot: a new connection
    gets 503 instead of cutting one of them, until --body-read-timeout cuts them with 408;
    then clients are served again."""
    busy = []
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    ).encode()
    for _ in range(MAX_CONNECTIONS):
        sock = connect(guard_server)
        sock.sendall(head)
        busy.append(sock)
    time.sleep(0.5)  # every head has been read: all 50 have a request in flight
    refused = httpx.get(f"{guard_server.url}/health", timeout=10)
    assert refused.status_code == 503
    assert "--max-connections" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    assert not any(map(closed_now, busy))
    for sock in busy:
        answer = read_until_closed(sock, BODY_TIMEOUT + 20)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"--body-read-timeout" in answer
    innocent_is_served(guard_server)


# -- the API key and CORS -----------------------------------------------------------------------
def test_two_authorization_headers_are_refused(guard_server: Server) -> None:
    good = ("Authorization", f"Bearer {API_KEY}")
    bad = ("Authorization", "Bearer wrong")
    for headers in ([good, good], [good, bad], [bad, good]):
        r = httpx.get(f"{guard_server.url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert "2 Authorization headers" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{guard_server.url}/v1/models", headers=[good], timeout=10)
    assert r.status_code == 200


def test_the_key_is_checked_before_the_body_is_read(guard_server: Server) -> None:
    """Without a key, a request announcing a large body gets its 401 at once (the body is
    not waited for) and the connection is closed, so the rest is never read."""
    sock = connect(guard_server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n{"
    )
    answer = read_until_closed(sock, 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert b"connection: close" in answer.lower()


def test_cors_preflight_is_answered_without_the_key(guard_server: Server) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{guard_server.url}/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # another origin is not allowed
    other = {**preflight, "Origin": "https://evil.example"}
    r = httpx.options(f"{guard_server.url}/v1/chat/completions", headers=other, timeout=10)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # the real request still needs the key, and its 401 is readable by the page
    r = httpx.get(f"{guard_server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{guard_server.url}/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_without_cors_flags_there_are_no_cors_headers() -> None:
    from fastapi.testclient import TestClient

    client = TestClient(build_app(ServerState(api_key=API_KEY)))
    r = client.options(
        "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
    )
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers


# -- the published schema and the server agree (schemathesis' four "valid request rejected") ----
# As guard_server's: --scheduling-policy priority (any int64 priority), --max-tokens-limit 8
DOCUMENT = build_app(
    ServerState(api_key=API_KEY, priority_scheduling=True, limits=Limits(max_tokens_limit=8))
).openapi()


def schema_errors(component: str, body: dict[str, Any]) -> list[str]:
    schema = {"$ref": f"#/components/schemas/{component}", "components": DOCUMENT["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    return [e.message for e in validator.iter_errors(body)]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
CASES = [
    # (route, body schema, invalid body, a valid neighbour)
    ("/detokenize", "DetokenizeRequest", {"tokens": [-1]}, {"tokens": [0]}),
    (
        "/tokenize",
        "TokenizeRequest",
        {"prompt": "hi", "messages": CHAT["messages"]},
        {"messages": CHAT["messages"]},
    ),
    ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "guided_choice": []},
     {**CHAT, "guided_choice": ["yes"]}),
    ("/v1/embeddings", "EmbeddingRequest", {"input": "hi", "priority": 2**63},
     {"input": "hi", "priority": 2**63 - 1}),
]  # fmt: skip


@pytest.mark.parametrize(("route", "component", "invalid", "valid"), CASES)
def test_the_schema_refuses_what_the_server_refuses(
    guard_server: Server, route: str, component: str, invalid: dict[str, Any], valid: dict[str, Any]
) -> None:
    assert schema_errors(component, invalid), "the published schema admits it"
    r = httpx.post(f"{guard_server.url}{route}", json=invalid, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert schema_errors(component, valid) == []
    r = httpx.post(f"{guard_server.url}{route}", json=valid, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_tokenize_input_rules_match_the_schema(guard_server: Server) -> None:
    for body in ({}, {"prompt": None}, {"prompt": "hi", "messages": None}, {"messages": []}):
        assert schema_errors("TokenizeRequest", body), body
        r = httpx.post(f"{guard_server.url}/tokenize", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, (body, r.text)
    r = httpx.post(f"{guard_server.url}/tokenize", json={"prompt": "hi"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_openai_client_still_works_through_the_guard(guard_server: Server) -> None:
    client = guard_server.client(max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{guard_server.url}/v1", api_key="wrong", max_retries=0
        ).models.list()
    assert [m.id for m in client.models.list().data] == [TINY]


# -- the flags ----------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_http_flags_defaults_and_vllm_spellings() -> None:
    limits = http_limits_from_args(parse())
    assert limits == HttpLimits()
    assert (limits.max_header_bytes, limits.max_header_count) == (64 * 1024, 256)
    assert (limits.header_read_timeout, limits.keep_alive_timeout) == (10.0, 5.0)
    assert limits.body_read_timeout == 60.0
    assert (limits.max_connections, limits.backlog) == (1024, 2048)
    assert not cors_from_args(parse()).enabled
    args = parse("--h11-max-incomplete-event-size", "4MiB", "--h11-max-header-count", "100")
    assert (args.max_header_bytes, args.max_header_count) == (4 * MiB, 100)
    cors = cors_from_args(
        parse("--allowed-origins", '["https://a.example", "https://b.example"]',
              "--allowed-methods", "GET,POST", "--allow-credentials")
    )  # fmt: skip
    assert cors.allowed_origins == ("https://a.example", "https://b.example")
    assert cors.allowed_methods == ("GET", "POST") and cors.allowed_headers == ("*",)
    assert cors.enabled and cors.allow_credentials


def test_bad_http_flags_exit_2_naming_the_flag() -> None:
    for flags, name in [
        (("--max-connections", "0"), "--max-connections"),
        (("--header-read-timeout", "nan"), "--header-read-timeout"),
        (("--body-read-timeout", "0"), "--body-read-timeout"),
        (("--max-header-bytes", "100"), "--max-header-bytes"),
    ]:
        with pytest.raises(ValueError, match=name):
            http_limits_from_args(parse(*flags))
    r = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--max-connections", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--max-connections" in r.stderr


def test_the_fd_limit_is_raised_to_fit_the_cap_or_the_cap_lowered() -> None:
    """In a child process (the limits are per process): a low soft limit is raised to fit
    --max-connections; a hard limit too low for it lowers the cap instead."""
    script = """
import resource
from kvserve.server.http_guard import HttpLimits, raise_fd_limit
N = resource.RLIMIT_NOFILE
resource.setrlimit(N, (300, 5000))
print(raise_fd_limit(HttpLimits()).max_connections, resource.getrlimit(N)[0])
resource.setrlimit(N, (500, 500))
print(raise_fd_limit(HttpLimits()).max_connections, resource.getrlimit(N)[0])
"""
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["1024 1280", "244 500"]
    assert "--max-connections 1024 lowered to 244" in r.stderr
