"""The request shapes agent tools send, replayed through the official SDKs against a real
``kvserve serve`` (the built-in model with auto tool choice, as docs/server.md's "Agent tools"
configures it). The shapes were recorded from Claude Code 2.1.197 and Codex 0.171.0 driving
kvserve (docs/server.md); the tools themselves need Node and are not run here.

Claude Code: ``system`` as text blocks with ``cache_control``, a ``system`` message after the
user's, tools with ``input_schema`` (``$schema`` 2020-12), adaptive thinking, effort "high",
``context_management`` keeping all thinking, ``metadata.user_id``, the ``anthropic-beta``
header, streaming; then a ``tool_use`` streamed as ``input_json_delta``s and a
``tool_result`` turn. Codex: developer messages, function tools with ``strict: false``,
``include: ["reasoning.encrypted_content"]``, ``store: false``, ``prompt_cache_key``,
``client_metadata``, streaming, and a ``function_call_output`` turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.anthropic.test_messages import TOOL_USE_ID, check_ids, summary
from tests.server.conftest import API_KEY, BUILTIN, Server, start_server

pytestmark = pytest.mark.slow

BASH_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to run", "maxLength": 12},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
    },
    "required": ["command"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": BASH_SCHEMA},
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem.",
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["file_path"],
            "additionalProperties": False,
        },
    },
]
CACHED = {"type": "ephemeral"}
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
    {"type": "text", "text": "You are a Claude agent.", "cache_control": CACHED},
]
FIRST_TURN = [
    {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Today's date is 2026-11-28.</system-reminder>"},
        {"type": "text", "text": "List the files here.", "cache_control": CACHED},
    ]},
    {"role": "system", "content": "Available agent types for the Agent tool: none."},
]  # fmt: skip
CLAUDE_CODE = {
    "system": SYSTEM,
    "tools": TOOLS,
    "thinking": {"type": "adaptive"},
    "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
    "extra_body": {
        "temperature": 0,
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    },
    "extra_headers": {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
}


@pytest.fixture(scope="module")
def agent_server(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "agent_server.log"
    srv = start_server(
        [
            str(builtin_model_dir), "--served-model-name", BUILTIN,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--num-kv-blocks", "400", "--max-num-seqs", "8",
            # float32 on every CPU: a bf16 prefill that hits the prefix cache computes only the
            # suffix, whose other rounding changed the greedy text between two equal requests
            "--dtype", "float32",
        ],
        log,
        api_key=API_KEY,
    )  # fmt: skip
    yield srv
    srv.stop()


def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def streamed_and_unary(server: Server, **kw: Any) -> anthropic.types.Message:
    c = claude(server)
    with c.messages.stream(model=BUILTIN, **kw) as s:
        events = list(s)
        streamed = s.get_final_message()
    unary = c.messages.create(model=BUILTIN, **kw)
    assert summary(streamed) == summary(unary)
    check_ids(streamed)
    calls = [b for b in streamed.content if b.type == "tool_use"]
    if calls and calls[-1].input:  # its input_json_delta pieces add up to the call's input
        pieces = "".join(e.partial_json for e in events if e.type == "input_json")
        assert json.loads(pieces) == calls[-1].input
    return streamed


def test_claude_code_turns(agent_server: Server) -> None:
    """Claude Code's first request (tool choice auto), a forced Bash call streamed as
    input_json_delta, and the tool_result turn after it: all 200, streamed = unary."""
    first = streamed_and_unary(agent_server, max_tokens=8, messages=FIRST_TURN, **CLAUDE_CODE)
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    bash = {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True}
    call_turn = streamed_and_unary(
        agent_server, max_tokens=64, messages=FIRST_TURN, tool_choice=bash, **CLAUDE_CODE
    )
    assert call_turn.stop_reason == "tool_use"
    (call,) = [b for b in call_turn.content if b.type == "tool_use"]
    assert call.name == "Bash" and TOOL_USE_ID.fullmatch(call.id)
    jsonschema.validate(call.input, BASH_SCHEMA)
    history = [
        *FIRST_TURN,
        {"role": "assistant",
         "content": [b.model_dump(exclude_none=True) for b in call_turn.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id,
             "content": [{"type": "text", "text": "README.md\nsetup.py"}], "is_error": False},
            {"type": "text", "text": "Thanks.", "cache_control": CACHED},
        ]},
    ]  # fmt: skip
    answer = streamed_and_unary(agent_server, max_tokens=8, messages=history, **CLAUDE_CODE)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude(agent_server).messages.count_tokens(
        model=BUILTIN,
        messages=history,
        system=SYSTEM,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    u = answer.usage
    assert counted.input_tokens == u.input_tokens + (u.cache_read_input_tokens or 0)


CODEX_TOOLS = [
    {
        "type": "function", "name": "exec_command", "strict": False,
        "description": "Runs a command in a PTY.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"], "additionalProperties": False},
    },
]  # fmt: skip


def _text(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


CODEX_INPUT = [
    _text("developer", "You are a coding agent running in the Codex CLI."),
    _text("user", "<environment_context><cwd>/w</cwd></environment_context>"),
    _text("user", "Say hi"),
]
CODEX = {
    "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
    "store": False, "include": ["reasoning.encrypted_content"], "reasoning": {},
    "prompt_cache_key": "01a22244-3252", "temperature": 0,
    "extra_body": {"client_metadata": {"session_id": "01a22244-3252"}},
}  # fmt: skip


def test_codex_turns(agent_server: Server) -> None:
    """Codex's request (with the configuration docs/server.md gives), streamed, and a
    function_call_output turn; the streamed response equals the unary one."""
    client = openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key=API_KEY, max_retries=0)
    kw: dict[str, Any] = {"model": BUILTIN, "max_output_tokens": 8, **CODEX}
    with client.responses.stream(input=CODEX_INPUT, **kw) as s:  # type: ignore[arg-type]
        *_, last = list(s)  # completed, or incomplete when max_output_tokens cut it
    assert last.type in ("response.completed", "response.incomplete")
    streamed = last.response  # type: ignore[union-attr]
    unary = client.responses.create(input=CODEX_INPUT, **kw)  # type: ignore[arg-type]
    assert streamed.output_text == unary.output_text
    assert streamed.status == unary.status and unary.status in ("completed", "incomplete")
    turn = [
        *CODEX_INPUT,
        {"type": "function_call", "call_id": "call_1", "name": "exec_command",
         "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
    ]  # fmt: skip
    r = client.responses.create(input=turn, **kw)  # type: ignore[arg-type]
    assert r.status in ("completed", "incomplete") and r.usage is not None
    assert r.usage.input_tokens > unary.usage.input_tokens  # type: ignore[union-attr]


def test_claude_code_bodies_are_valid_by_the_document(agent_server: Server) -> None:
    """``/openapi.json`` states each role's content blocks strictly (the fuzz test sends only
    what it allows), yet still allows what Claude Code sends; an image block it refuses."""
    document = httpx.get(f"{agent_server.url}/openapi.json", timeout=10).json()
    request = jsonschema.Draft202012Validator(
        {**document, "$ref": "#/components/schemas/MessagesRequest"}
    )
    fields = {k: v for k, v in CLAUDE_CODE.items() if k not in ("extra_body", "extra_headers")}
    call = {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "Bash",
            "input": {"command": "ls"}}  # fmt: skip
    history = [
        *FIRST_TURN,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": ""},
                                          {"type": "text", "text": "Listing."}, call]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call["id"],
             "content": [{"type": "text", "text": "README.md"}], "is_error": False},
            {"type": "text", "text": "Thanks.", "cache_control": CACHED},
        ]},
    ]  # fmt: skip
    body = {"model": BUILTIN, "max_tokens": 8, "messages": history, "stream": True,
            **fields, **CLAUDE_CODE["extra_body"]}  # type: ignore[dict-item]  # fmt: skip
    request.validate(body)
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    refused = [
        {**body, "messages": [{"role": "user", "content": [image]}]},
        {**body, "messages": [{"role": "user", "content": [call]}]},  # tool_use: assistant's
        {**body, "output_config": {"effort": "low"}},
        {**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    ]
    for bad in refused:
        assert not request.is_valid(bad), bad
