"""The rules a valid request must keep, published in ``/openapi.json`` (issue 28, item 7).

A client (or a generator such as schemathesis) that builds requests from the document must
not get a 400 for one the document allows: the document and the server's checks agree. Two
kinds of rule are added to FastAPI's generated schemas here, after the fact, so that the
request models (and their error messages) stay as they are:

- the engine's own bounds (``SamplingParams`` checks them: ``top_k`` >= -1, ``min_p`` in
  [0, 1], non-empty stop strings, non-negative token ids...), the same on every server;
- this server's limits, which differ by flags: ``--max-tokens-limit``, ``--max-n``,
  ``--max-logprobs``, ``--max-tools-per-request``, ``--max-chat-messages``,
  ``--max-prompts-per-request``, ``--scheduling-policy`` (``priority`` is 0 unless it is
  ``priority``), ``--trust-request-chat-template`` (``chat_template`` must be null
  without it) and ``--enable-auto-tool-choice`` / ``--tool-call-parser`` (``tool_choice``
  ``"auto"`` only with both; chat's and the Responses API's), ``--reasoning-parser``
  (``thinking_token_budget`` must be null without it).

What JSON Schema cannot state is listed in ``docs/server.md`` ("What the document cannot
say"): relations between fields (``min_tokens`` <= ``max_tokens``, ``stream_options`` only
with ``stream``), the model's context length and vocabulary, and whether a regex, grammar or
JSON schema compiles. ``tests/server/test_schemathesis.py`` checks every other 400 of a
generated valid request as a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PublishedLimits:
    """The flags-dependent part of what a valid request must keep (from ``ServerState``)."""

    max_tokens: int | None  # --max-tokens-limit (None: only the context bounds it)
    max_n: int  # --max-n
    max_prompts: int  # --max-prompts-per-request
    max_logprobs: int  # --max-logprobs (-1: the vocabulary, unbounded here)
    max_tools: int  # --max-tools-per-request
    max_messages: int  # --max-chat-messages
    priority_scheduling: bool  # --scheduling-policy priority: any int64 priority
    request_chat_template: bool  # --trust-request-chat-template
    auto_tool_choice: bool  # --enable-auto-tool-choice with a --tool-call-parser
    reasoning: bool = False  # --reasoning-parser: thinking_token_budget means something


# Bounds SamplingParams enforces (kvserve/sampling_params.py), for the fields' integer or
# number arm; the request models leave them to the engine so its messages stay the same.
_NUMBER_BOUNDS: dict[str, dict[str, int]] = {
    "top_k": {"minimum": -1},  # -1 and 0: off
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "min_tokens": {"minimum": 0},
    "dimensions": {"minimum": 1},  # embeddings (server/embeddings.py)
}
# Array fields: bounds of the array and of its items (SamplingParams again).
_ARRAY_BOUNDS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "stop": ({}, {"minLength": 1}),  # an empty stop string would match everywhere
    "stop_sequences": ({}, {"minLength": 1}),  # /v1/messages: chat's stop
    "stop_token_ids": ({}, {"minimum": 0}),
    "allowed_token_ids": ({"minItems": 1}, {"minimum": 0}),
    "bad_words": ({}, {"minLength": 1}),
    "guided_choice": ({}, {"minLength": 1}),  # structured_output/params.py: non-empty choices
    "choice": ({}, {"minLength": 1}),  # structured_outputs.choice
}
# Fields the server accepts only as null (or one value), stated as such.
_NULL_ONLY = {
    "suffix": "not supported; send null",
    "guided_whitespace_pattern": "not supported by xgrammar; send null",
}
_NON_EMPTY = ("guided_regex", "guided_grammar", "regex", "grammar", "guided_json", "json")
_BACKENDS = ["auto", "xgrammar"]  # guided_decoding_backend (server/structured.py)


# /score's and /rerank's texts (server/score.py)
_SCORE_TEXTS = ("text_1", "text_2", "query", "documents")


def publish_limits(schema: dict[str, Any], limits: PublishedLimits) -> None:
    """Edit the request schemas of ``schema`` (an OpenAPI document) in place."""
    for body in _request_schemas(schema):
        props = body.get("properties", {})
        for name, bounds in _NUMBER_BOUNDS.items():
            for arm in _arms(props.get(name), "integer", "number"):
                _tighten(arm, bounds)
        for name, (array, items) in _ARRAY_BOUNDS.items():
            for arm in _arms(props.get(name), "array"):
                arm.update(array)
                arm.setdefault("items", {}).update(items)
            if name == "stop":
                for arm in _arms(props.get(name), "string"):
                    arm.update(items)
        for name, why in _NULL_ONLY.items():
            if name in props:
                props[name] = {"type": "null", "default": None, "description": why}
        for arm in _arms(props.get("guided_decoding_backend"), "string"):
            arm["enum"] = _BACKENDS
        for name in _NON_EMPTY:  # structured_output/params.py: non-empty grammar texts
            for arm in _arms(props.get(name), "string"):
                arm["minLength"] = 1
        # no empty prompt, input, score text or document (nothing to compute)
        for name in ("input", "prompt", *_SCORE_TEXTS):
            for arm in _arms(props.get(name), "string", "array"):
                _non_empty(arm)
        for arm in _arms(props.get("logit_bias"), "object"):  # keys are token ids
            arm["propertyNames"] = {"pattern": "^[0-9]+$"}
        truncate = props.get("truncate_prompt_tokens")
        if truncate is not None:  # -1 (the context length) or a count (pooling_params.py)
            truncate["anyOf"] = [
                {"type": "integer", "enum": [-1]},
                {"type": "integer", "minimum": 1},
                {"type": "null"},
            ]
        _server_limits(props, limits)
        for example in body.get("examples", []):  # examples are valid requests too
            _clamp_example(example, props)
    if not limits.auto_tool_choice:
        _no_auto_messages_tool_choice(schema)


def _server_limits(props: dict[str, Any], limits: PublishedLimits) -> None:
    if limits.max_tokens is not None:
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            for arm in _arms(props.get(name), "integer"):
                arm["maximum"] = limits.max_tokens
            default = props.get(name, {}).get("default")
            if isinstance(default, int) and default > limits.max_tokens:
                props[name]["default"] = limits.max_tokens  # completions.py caps it so
    for name in ("n", "best_of"):  # best_of: the beam width with use_beam_search
        for arm in _arms(props.get(name), "integer"):
            arm["maximum"] = limits.max_n
    if limits.max_logprobs >= 0:
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            for arm in _arms(props.get(name), "integer"):  # chat's logprobs is a boolean
                arm["maximum"] = limits.max_logprobs
    for name, most in (("tools", limits.max_tools), ("messages", limits.max_messages)):
        for arm in _arms(props.get(name), "array"):
            arm["maxItems"] = most
    for name in ("prompt", "input", *_SCORE_TEXTS):  # score: pairs (documents) at most
        for arm in _arms(props.get(name), "array"):
            if arm.get("items", {}).get("type") in ("string", "array"):  # several prompts
                arm["maxItems"] = limits.max_prompts
    if not limits.priority_scheduling and "priority" in props:
        for arm in _arms(props["priority"], "integer"):
            arm.update(minimum=0, maximum=0)
        props["priority"]["description"] = "0 unless the server runs --scheduling-policy priority"
    if not limits.auto_tool_choice:  # server/tools.py: AUTO_TOOL_CHOICE_ERROR
        for arm in _arms(props.get("tool_choice"), "string"):
            if "auto" in arm.get("enum", ()):
                arm["enum"] = [c for c in arm["enum"] if c != "auto"]
    if not limits.reasoning and "thinking_token_budget" in props:  # chat_pipeline.py
        props["thinking_token_budget"] = {
            "type": "null",
            "default": None,
            "description": "needs the server's --reasoning-parser",
        }
    if not limits.request_chat_template and "chat_template" in props:
        props["chat_template"] = {
            "type": "null",
            "default": None,
            "description": "needs the server's --trust-request-chat-template",
        }


def _no_auto_messages_tool_choice(schema: dict[str, Any]) -> None:
    """``/v1/messages``' ``tool_choice`` (``ToolChoice``, anthropic/protocol.py) without
    ``auto``, as chat's: it needs --enable-auto-tool-choice and a --tool-call-parser."""
    choice = schema.get("components", {}).get("schemas", {}).get("ToolChoice")
    if choice is None:
        return
    for part in (choice, *choice.get("oneOf", [])):
        kind = part.get("properties", {}).get("type", {})
        if "auto" in kind.get("enum", ()):
            kind["enum"] = [c for c in kind["enum"] if c != "auto"]


def _tighten(arm: dict[str, Any], bounds: dict[str, int]) -> None:
    """Add ``bounds`` to ``arm`` without loosening a stricter one it has (Anthropic's
    ``top_k`` is ``>= 0`` where the engine takes -1 too)."""
    for key, value in bounds.items():
        if key not in arm:
            arm[key] = value
        elif key in ("minimum", "exclusiveMinimum"):
            arm[key] = max(arm[key], value)
        else:
            arm[key] = min(arm[key], value)


def _clamp_example(example: dict[str, Any], props: dict[str, Any]) -> None:
    """An example's integers within their fields' published maximum (``--max-tokens-limit 4``
    makes the example's ``max_tokens: 8`` invalid)."""
    for name, value in example.items():
        if isinstance(value, int) and not isinstance(value, bool):
            for arm in _arms(props.get(name), "integer"):
                if "maximum" in arm and value > arm["maximum"]:
                    example[name] = arm["maximum"]


def _non_empty(node: dict[str, Any]) -> None:
    """A string or (nested) array schema with at least one character or item everywhere."""
    if node.get("type") == "string":
        node["minLength"] = 1
    elif node.get("type") == "array":
        node["minItems"] = 1
        _non_empty(node.setdefault("items", {}))


def _arms(prop: dict[str, Any] | None, *types: str) -> Iterator[dict[str, Any]]:
    """The parts of a property schema of the given JSON types (itself, or its anyOf arms)."""
    if prop is None:
        return
    for arm in prop.get("anyOf", [prop]):
        if arm.get("type") in types:
            yield arm


def _request_schemas(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The component schemas that are request bodies, and the ones they nest by reference."""
    components = schema.get("components", {}).get("schemas", {})
    seen: set[str] = set()
    todo = [
        media.get("schema", {})
        for item in schema.get("paths", {}).values()
        for op in item.values()
        for media in op.get("requestBody", {}).get("content", {}).values()
    ]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rsplit("/", 1)[1]
                if name not in seen and name in components:
                    seen.add(name)
                    todo.append(components[name])
                    yield components[name]
            else:
                todo.extend(node.values())


def assistant_only_tool_calls(schema: dict[str, Any]) -> None:
    """``ChatMessage`` as one schema per kind of role: only assistant turns carry
    ``tool_calls`` (``server/tools.py`` refuses them elsewhere). A ``oneOf`` of two disjoint
    variants, which generators and validators read alike."""
    components = schema.get("components", {}).get("schemas", {})
    message = components.get("ChatMessage")
    if message is None or "oneOf" in message:
        return
    others = [r for r in message["properties"]["role"]["enum"] if r != "assistant"]
    assistant = _variant(message, {"type": "string", "const": "assistant"})
    other = _variant(message, {"type": "string", "enum": others})
    other["properties"]["tool_calls"] = {
        "anyOf": [{"type": "array", "maxItems": 0, "items": {}}, {"type": "null"}],
        "default": None,
        "description": "only assistant messages have tool_calls",
    }
    components["ChatMessage"] = {
        "title": message.get("title", "ChatMessage"),
        "oneOf": [assistant, other],
    }


def json_schema_needs_its_schema(schema: dict[str, Any]) -> None:
    """``response_format`` of type ``json_schema`` carries ``json_schema.schema`` (an object;
    ``server/structured.py`` refuses it otherwise): two variants, by type."""
    components = schema.get("components", {}).get("schemas", {})
    rf, fmt = components.get("ResponseFormat"), components.get("JsonSchemaFormat")
    if rf is None or fmt is None or "oneOf" in rf:
        return
    given = {**fmt, "required": ["schema"]}
    given["properties"] = {**fmt["properties"], "schema": {"type": "object"}}
    others = [t for t in rf["properties"]["type"]["enum"] if t != "json_schema"]
    plain = {**rf, "properties": {**rf["properties"], "type": {"type": "string", "enum": others}}}
    with_schema = {
        **rf,
        "required": ["type", "json_schema"],
        "properties": {"type": {"type": "string", "const": "json_schema"}, "json_schema": given},
    }
    for variant in (plain, with_schema):
        variant.pop("title", None)
    components["ResponseFormat"] = {"title": "ResponseFormat", "oneOf": [plain, with_schema]}


def _variant(message: dict[str, Any], role: dict[str, Any]) -> dict[str, Any]:
    variant = {**message, "properties": {**message["properties"], "role": role}}
    variant.pop("title", None)
    return variant
