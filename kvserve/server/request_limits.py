"""The cost limits of one request (issue 28): what a small, valid request may ask the server
to build or compute. Each limit has a ``kvserve serve`` flag and a default that protects a
small machine; going over it is a 400 that names the flag, decided before any costly work
(tokenizing, templating, compiling a grammar, queueing).

- ``--max-tools-per-request``: tools in one chat request (each may become a grammar branch).
- ``--max-json-schema-bytes`` / ``--max-json-schema-enum-members``: the JSON schema a grammar
  is compiled from (``response_format``, ``guided_json``, ``structured_outputs.json``, and the
  schema ``tool_choice: "required"`` or a named tool builds from the tools); ``guided_choice``
  counts its choices as enum members.
- ``--max-grammar-bytes``: regex, grammar and structural-tag text (and ``guided_choice``'s
  strings together).
- ``--max-logprobs`` (vLLM's, an engine option): logprobs per token, prompt logprobs included.
- ``--max-chat-messages`` / ``--max-chat-bytes``: a conversation's messages and their text.
The sequences per request (prompts x n, ``--max-num-seqs-per-request``) are checked with the
other fan-out limits in ``serving.check_fan_out``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvserve.engine.input_processor import logprobs_over_cap
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import ChatMessage
from kvserve.server.serving import Limits
from kvserve.structured_output import StructuredOutputsParams

# The request fields that carry a structured-output constraint, in the order they are named.
_STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip


def _over(what: str, value: int, limit: int, unit: str, flag: str, param: str) -> APIError:
    return bad_request(
        f"{what} {value} {unit}, above this server's limit of {limit} ({flag})", param
    )


def check_tools(limits: Limits, tools: Sequence[Any] | None) -> None:
    """400 for more tools than ``--max-tools-per-request`` (before any tool is looked at)."""
    count = len(tools or ())
    if count > limits.max_tools_per_request:
        raise _over(
            "the request has", count, limits.max_tools_per_request, "tools",
            "--max-tools-per-request", "tools",
        )  # fmt: skip


def _message_bytes(m: ChatMessage) -> int:
    size = len(m.text().encode("utf-8", "surrogatepass"))
    size += len((m.thinking() or "").encode("utf-8", "surrogatepass"))
    for call in m.tool_calls or ():
        args = call.function.arguments
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        size += len(text.encode("utf-8", "surrogatepass"))
    return size


def check_chat(
    limits: Limits,
    messages: Sequence[ChatMessage],
    documents: Sequence[dict[str, str]] | None = None,
) -> None:
    """400 for a conversation over ``--max-chat-messages`` or ``--max-chat-bytes`` (the UTF-8
    bytes of the messages' text, their tool calls' arguments and the documents): the chat
    template renders all of it and the tokenizer reads all of it."""
    if len(messages) > limits.max_chat_messages:
        raise _over(
            "the conversation has", len(messages), limits.max_chat_messages, "messages",
            "--max-chat-messages", "messages",
        )  # fmt: skip
    size = 0
    for m in messages:
        size += _message_bytes(m)
    for doc in documents or ():
        size += sum(len(str(v).encode("utf-8", "surrogatepass")) for v in doc.values())
    if size > limits.max_chat_bytes:
        raise _over(
            "the conversation has", size, limits.max_chat_bytes, "bytes of text",
            "--max-chat-bytes", "messages",
        )  # fmt: skip


def _enum_members(schema: Any) -> int:
    """Members of every ``enum`` anywhere in ``schema``; iterative, so that a deeply nested
    schema cannot exhaust the stack."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list):
                count += len(enum)
            stack.extend(v for k, v in node.items() if k != "enum")
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _schema_cost(schema: str | dict[str, Any]) -> tuple[int, int]:
    """(bytes, enum members) of a JSON schema given as a dict or as JSON text."""
    if isinstance(schema, str):
        size = len(schema.encode("utf-8", "surrogatepass"))
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return size, 0  # the compiler refuses it with its own reason
    else:
        size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
    return size, _enum_members(schema)


def check_structured(limits: Limits, so: StructuredOutputsParams | None, param: str) -> None:
    """400 for a structured-output constraint larger than the server compiles: a JSON schema
    over ``--max-json-schema-bytes`` or ``--max-json-schema-enum-members``, a regex, grammar or
    structural tag over ``--max-grammar-bytes``, a choice list over either."""
    if so is None:
        return
    if so.json is not None:
        size, members = _schema_cost(so.json)
        if size > limits.max_json_schema_bytes:
            raise _over(
                "the JSON schema has", size, limits.max_json_schema_bytes, "bytes",
                "--max-json-schema-bytes", param,
            )  # fmt: skip
        if members > limits.max_json_schema_enum_members:
            raise _over(
                "the JSON schema has", members, limits.max_json_schema_enum_members,
                "enum members", "--max-json-schema-enum-members", param,
            )  # fmt: skip
        return
    if so.choice is not None:
        if len(so.choice) > limits.max_json_schema_enum_members:
            raise _over(
                "the choice list has", len(so.choice), limits.max_json_schema_enum_members,
                "choices", "--max-json-schema-enum-members", param,
            )  # fmt: skip
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in so.choice)
    else:
        text = so.regex or so.grammar or so.structural_tag or ""
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise _over(
            f"the {so.kind} has", size, limits.max_grammar_bytes, "bytes",
            "--max-grammar-bytes", param,
        )  # fmt: skip


def structured_param(req: Any) -> str:
    """The request field the structured-output constraint came from (for the 400's param)."""
    return next((f for f in _STRUCTURED_FIELDS if getattr(req, f, None) is not None), "tools")


def check_logprobs(
    params: SamplingParams, max_logprobs: int, vocab_size: int, logprobs_field: str
) -> None:
    """The engine's ``--max-logprobs`` check, made before the grammar compiles; the 400 names
    the request's own field (``top_logprobs`` on chat, ``logprobs`` on completions, whose
    ``echo`` asks the same number for the prompt)."""
    over = logprobs_over_cap(params, max_logprobs, vocab_size)
    if over is None:
        return
    name, value, cap = over
    field = logprobs_field if name == "logprobs" else name
    raise _over(f"{field} is", value, cap, "logprobs per token", "--max-logprobs", field)


def check_request_cost(
    limits: Limits, engine: Any, params: SamplingParams, req: Any, logprobs_field: str
) -> None:
    """Every cost limit on a request's ``SamplingParams`` (structured output, logprobs): run
    after the params are built and before the grammar compiles or the request is queued."""
    check_structured(limits, params.structured_outputs, structured_param(req))
    check_logprobs(params, engine.config.model.max_logprobs, engine.vocab_size, logprobs_field)
