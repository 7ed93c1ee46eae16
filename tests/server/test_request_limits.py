"""The cost limits of one request (issue 28) against a live ``kvserve serve``: each limit's 400
names its flag, and a request exactly at the limit is served.

One server with small limits (the tiny random model, so that the requests that pass cost
nothing), and one that admits 1 MB conversations, for the event loop's latency while they are
templated and tokenized.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.server.cli import _model_specs, add_serve_parser, build_state
from kvserve.server.serving import Limits
from tests.server.conftest import TINY, Server, start_server

pytestmark = pytest.mark.slow

LIMITS = {
    "--max-n": 4, "--max-prompts-per-request": 4, "--max-num-seqs-per-request": 6,
    "--max-tools-per-request": 3, "--max-json-schema-bytes": 1000,
    "--max-json-schema-enum-members": 10, "--max-grammar-bytes": 100,
    "--max-chat-messages": 4, "--max-chat-bytes": 1000, "--max-logprobs": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "limits_server.log"
    flags = [str(x) for kv in LIMITS.items() for x in kv]
    srv = start_server(
        [str(tiny_model_dir), "--served-model-name", TINY, "--num-kv-blocks", "64", *flags],
        log,
    )
    yield srv
    srv.stop()


def post(server: Server, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=timeout)


def chat(server: Server, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields
    return post(server, "/v1/chat/completions", body)


def complete(server: Server, **fields: Any) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2} | fields)


def assert_refused(r: httpx.Response, message: str, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": param, "code": 400,
    }  # fmt: skip


def assert_served(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text


def compact_size(schema: dict[str, Any]) -> int:
    return len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())


def padded_schema(size: int) -> dict[str, Any]:
    """An object schema of exactly ``size`` bytes as compact JSON (padded in its description)."""
    schema: dict[str, Any] = {"type": "object", "description": ""}
    schema["description"] = "d" * (size - compact_size(schema))
    assert compact_size(schema) == size
    return schema


def tools(count: int) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(count)
    ]


def test_sequences_per_request(small: Server) -> None:
    assert_served(complete(small, prompt=["a", "b", "c"], n=2))  # 6: at the limit
    assert_refused(
        complete(small, prompt=["a", "b", "c", "d"], n=2),
        "the request asks for 4 prompts x n=2 = 8 sequences, above this server's limit of 6 "
        "(--max-num-seqs-per-request)", "n",
    )  # fmt: skip


def test_tools_per_request(small: Server) -> None:
    assert_served(chat(small, tools=tools(3), tool_choice="required"))
    message = "the request has 4 tools, above this server's limit of 3 (--max-tools-per-request)"
    assert_refused(chat(small, tools=tools(4), tool_choice="none"), message, "tools")
    r = post(small, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                  "tools": tools(4)})  # fmt: skip
    assert_refused(r, message, "tools")


def test_json_schema_bytes(small: Server) -> None:
    assert_served(chat(small, guided_json=padded_schema(1000)))
    message = (
        "the JSON schema has 1001 bytes, above this server's limit of 1000 "
        "(--max-json-schema-bytes)"
    )
    assert_refused(chat(small, guided_json=padded_schema(1001)), message, "guided_json")
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": padded_schema(1001)}}
    assert_refused(complete(small, response_format=rf), message, "response_format")
    # the schema tool_choice "required" builds from the tools counts too
    big = tools(1)
    big[0]["function"]["parameters"] = padded_schema(1000)
    r = chat(small, tools=big, tool_choice="required")
    assert r.status_code == 400 and "(--max-json-schema-bytes)" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tools"


def test_json_schema_enum_members(small: Server) -> None:
    ten = {"type": "string", "enum": [f"v{i}" for i in range(10)]}
    assert_served(chat(small, guided_json=ten, max_tokens=4))
    # counted across the schema: two enums of 6
    six = {"type": "string", "enum": [f"v{i}" for i in range(6)]}
    nested = {"type": "object", "properties": {"a": six, "b": {"anyOf": [six]}}}
    assert_refused(
        chat(small, guided_json=nested),
        "the JSON schema has 12 enum members, above this server's limit of 10 "
        "(--max-json-schema-enum-members)", "guided_json",
    )  # fmt: skip
    assert_served(complete(small, guided_choice=[f"c{i}" for i in range(10)]))
    assert_refused(
        complete(small, guided_choice=[f"c{i}" for i in range(11)]),
        "the choice list has 11 choices, above this server's limit of 10 "
        "(--max-json-schema-enum-members)", "guided_choice",
    )  # fmt: skip


def test_grammar_bytes(small: Server) -> None:
    assert_served(complete(small, guided_regex="a" * 100))
    assert_refused(
        complete(small, guided_regex="a" * 101),
        "the regex has 101 bytes, above this server's limit of 100 (--max-grammar-bytes)",
        "guided_regex",
    )  # fmt: skip
    grammar = 'root ::= "' + "b" * 89 + '"'  # 100 bytes
    assert len(grammar) == 100
    assert_served(chat(small, structured_outputs={"grammar": grammar}))
    assert_refused(
        chat(small, structured_outputs={"grammar": grammar + " "}),
        "the grammar has 101 bytes, above this server's limit of 100 (--max-grammar-bytes)",
        "structured_outputs",
    )  # fmt: skip


def test_max_logprobs(small: Server) -> None:
    assert_served(chat(small, logprobs=True, top_logprobs=3, prompt_logprobs=3))
    assert_served(complete(small, logprobs=3, echo=True))  # 3 prompt logprobs too
    over = "is 4 logprobs per token, above this server's limit of 3 (--max-logprobs)"
    assert_refused(chat(small, logprobs=True, top_logprobs=4), f"top_logprobs {over}",
                   "top_logprobs")  # fmt: skip
    assert_refused(complete(small, logprobs=4), f"logprobs {over}", "logprobs")
    assert_refused(complete(small, logprobs=4, echo=True), f"logprobs {over}", "logprobs")
    assert_refused(chat(small, prompt_logprobs=4), f"prompt_logprobs {over}", "prompt_logprobs")
    assert_refused(complete(small, prompt_logprobs=4), f"prompt_logprobs {over}",
                   "prompt_logprobs")  # fmt: skip


def test_chat_messages_and_bytes(small: Server) -> None:
    four = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
    assert_served(chat(small, messages=four))
    message = (
        "the conversation has 5 messages, above this server's limit of 4 (--max-chat-messages)"
    )
    five = [*four, {"role": "user", "content": "hi"}]
    assert_refused(chat(small, messages=five), message, "messages")
    assert_refused(post(small, "/tokenize", {"messages": five}), message, "messages")
    # 1000 bytes of UTF-8 text: "é" is 2 bytes
    text = [{"role": "system", "content": "é" * 250}, {"role": "user", "content": "x" * 500}]
    assert_served(chat(small, messages=text))
    assert post(small, "/tokenize", {"messages": text}).status_code == 200
    text[1]["content"] += "x"
    message = (
        "the conversation has 1001 bytes of text, above this server's limit of 1000 "
        "(--max-chat-bytes)"
    )
    assert_refused(chat(small, messages=text), message, "messages")
    assert_refused(post(small, "/tokenize", {"messages": text}), message, "messages")


def test_the_server_still_serves(small: Server) -> None:
    assert httpx.get(f"{small.url}/health", timeout=10).status_code == 200
    assert_served(chat(small))


# -- the flags and the offline side ---------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_and_defaults() -> None:
    limits = build_state(parse(), EngineArgs()).limits
    assert limits == Limits(
        max_num_seqs_per_request=256, max_tools_per_request=128,
        max_json_schema_bytes=65536, max_json_schema_enum_members=1024,
        max_grammar_bytes=65536, max_chat_messages=1024, max_chat_bytes=1024 * 1024,
    )  # fmt: skip
    args = parse("--max-chat-bytes", "2MiB", "--max-grammar-bytes", "1KiB", "--max-logprobs", "5")
    assert (args.max_chat_bytes, args.max_grammar_bytes) == (2 * 1024**2, 1024)
    assert EngineArgs.from_cli_args(args).max_logprobs == 5
    for flag in ("--max-num-seqs-per-request", "--max-tools-per-request", "--max-chat-bytes",
                 "--max-json-schema-enum-members"):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{flag} must be >= 1, got 0$"):
            _model_specs(parse(flag, "0"))
    with pytest.raises(ValueError, match=r"--max-logprobs\) must be >= 0, or -1"):
        EngineArgs(max_logprobs=-2)


def test_offline_max_logprobs(tiny_model_dir: Path) -> None:
    """``LLM(max_logprobs=...)``: the engine refuses what the server's 400 refuses."""
    llm = LLM(str(tiny_model_dir), max_logprobs=2, num_kv_blocks=16)
    message = "above the engine's limit of 2 logprobs per token (max_logprobs, --max-logprobs)"
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError) as e:
            llm.generate("hi", SamplingParams(max_tokens=1, **{field: 3}), use_tqdm=False)
        assert str(e.value) == f"{field} is 3, {message}"
    (out,) = llm.generate(
        "hi", SamplingParams(max_tokens=1, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )
    assert out.prompt_logprobs is not None and len(out.outputs[0].logprobs or []) == 1
    unlimited = LLM(str(tiny_model_dir), max_logprobs=-1, num_kv_blocks=16)  # the vocabulary
    (out,) = unlimited.generate("hi", SamplingParams(max_tokens=1, logprobs=100), use_tqdm=False)
    assert len((out.outputs[0].logprobs or [{}])[0]) >= 100


# -- nothing CPU-heavy on the event loop ----------------------------------------------------
CHATS = 12
CHAT_BYTES = 1_000_000
HEALTH_POLLS = 20


@pytest.fixture(scope="module")
def big_chats(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "big_chat_server.log"
    srv = start_server(
        [
            str(tiny_model_dir), "--served-model-name", TINY, "--num-kv-blocks", "64",
            "--max-request-body-bytes", "2MiB", "--max-chat-bytes", "2MiB",
        ],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


def poll_health(client: httpx.Client) -> list[float]:
    """The latencies of ``HEALTH_POLLS`` sequential /health requests, sorted, in seconds."""
    latencies = []
    for _ in range(HEALTH_POLLS):
        t = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(round(time.perf_counter() - t, 4))
        time.sleep(0.1)
    return sorted(latencies)


def test_health_answers_while_big_chats_are_templated(big_chats: Server) -> None:
    """12 concurrent 1 MB single-message chats (issue 28's reproducer froze /health for 13.5 s)
    leave /health answering in under 500 ms: templating and tokenizing run off the loop."""
    content = ("All work and no play makes Jack a dull boy. " * 25_000)[:CHAT_BYTES]
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    started = threading.Event()

    def send(_: int) -> httpx.Response:
        started.set()
        return httpx.post(
            f"{big_chats.url}/v1/chat/completions", content=body, timeout=300,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip

    # a long timeout: a blocked loop shows as a latency in the failure, not a timeout
    with httpx.Client(base_url=big_chats.url, timeout=120) as health:
        idle = poll_health(health)  # the machine's own noise, for the failure message
        with ThreadPoolExecutor(CHATS) as pool:
            answers = pool.map(send, range(CHATS))
            started.wait()
            # Polled once the bodies are in: reading and parsing 12 MB of JSON (~5 ms per MB
            # on the loop, as in any Python server) is the HTTP layer's cost, not what this
            # test is about; the ~20 s of templating and tokenizing that follow are.
            time.sleep(2.0)
            loaded = poll_health(health)
            polls_done = time.perf_counter()
            results = list(answers)
            in_flight_after_polls = time.perf_counter() - polls_done
    print(f"/health seconds, idle: {idle}, under 12 1 MB chats: {loaded}")
    # 0.5 s: one chat templated on the loop would block it ~1.7 s (20 s for 12); the GIL
    # shared with the templating threads and a second test worker on 2 cores put one poll at
    # 125 ms (one full-suite run, 2026-11-29), past the 100 ms this bound first was
    assert max(loaded) < 0.5, f"under load: {loaded}; idle: {idle}"
    # the polls ran while the chats were still being templated and tokenized
    assert in_flight_after_polls > 1.0
    # Each prompt (~250k tokens) is far beyond the tiny model's 1024-token context.
    for r in results:
        assert r.status_code == 400, r.text
        assert "maximum context length is 1024 tokens" in r.json()["error"]["message"]
