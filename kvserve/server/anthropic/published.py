"""What the Messages API's document publishes beyond the request models' loose types.

The models read content blocks, tools and a few fields loosely (``Block.type`` is any string)
so that ``translate.py`` can refuse an unsupported one with a 400 that names it, in Anthropic's
error shape, rather than with pydantic's union error. The document, though, states what the
server accepts (a generated valid request must get a 2xx: ``tests/server/test_schemathesis.py``):
these schemas go in through the models' ``json_schema_extra``, so validation is unchanged.

- each role's blocks: user ``text`` / ``tool_result``, assistant ``text`` / ``tool_use`` /
  ``thinking`` / ``redacted_thinking``, system ``text``; each block type with its required
  fields (``translate.py`` refuses a block without them);
- tools: custom ones only (``type`` absent, null or ``custom``);
- ``output_config.effort``: ``high`` only; ``context_management``: ``clear_thinking_*`` edits
  keeping ``all``; ``mcp_servers``, ``container``, ``inference_geo``, ``speed``: null.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

# Request fields of Anthropic's API that kvserve refuses when given (not null).
UNSUPPORTED_FIELDS = {
    "mcp_servers": "MCP servers (the client must run its tools itself)",
    "container": "code-execution containers",
    "inference_geo": "inference_geo",
    "speed": "speed modes",
}
_STR = {"type": "string"}
_NULL = {"type": "null"}
# Block's other fields, as the model reads them, so that a block of one type may carry the
# others' fields (the server ignores them) without the document promising a type the model
# refuses; ``content`` (a list of blocks) only on tool_result.
_ANY_BLOCK: dict[str, Any] = {
    **{
        name: {"anyOf": [_STR, _NULL]}
        for name in ("text", "thinking", "signature", "id", "name", "tool_use_id")
    },
    "input": {"anyOf": [{"type": "object"}, _NULL]},
    "is_error": {"anyOf": [{"type": "boolean"}, _NULL]},
    "content": _NULL,
}


def _block(kind: str, required: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    properties = {**_ANY_BLOCK, **(optional or {}), **required, "type": {"const": kind}}
    return {
        "type": "object",
        "title": f"{kind} block",
        "properties": properties,
        "required": ["type", *required],
    }


TEXT = _block("text", {"text": _STR})
_TOOL_RESULT = _block(
    "tool_result",
    {"tool_use_id": _STR},
    {"content": {"anyOf": [_STR, {"type": "array", "items": TEXT}, _NULL]}},
)
_TOOL_USE = _block(
    "tool_use",
    {"id": _STR, "name": {"type": "string", "minLength": 1}, "input": {"type": "object"}},
)
_THINKING = _block("thinking", {"thinking": _STR})
_REDACTED = _block("redacted_thinking", {})
BLOCKS_BY_ROLE = {
    "user": [TEXT, _TOOL_RESULT],
    "assistant": [TEXT, _TOOL_USE, _THINKING, _REDACTED],
    "system": [TEXT],
}


def _content(blocks: list[Any]) -> dict[str, Any]:
    items = blocks[0] if len(blocks) == 1 else {"oneOf": blocks}
    return {"anyOf": [_STR, {"type": "array", "items": items}]}


def message_by_role(schema: dict[str, Any]) -> None:
    """``MessageParam``: one variant per role, each with the blocks that role takes."""
    schema.pop("properties", None)
    schema.pop("required", None)
    schema["oneOf"] = [
        {
            "type": "object",
            "properties": {"role": {"const": role}, "content": deepcopy(_content(blocks))},
            "required": ["role", "content"],
        }
        for role, blocks in BLOCKS_BY_ROLE.items()
    ]


def custom_tools_only(schema: dict[str, Any]) -> None:
    """``Tool``: ``type`` absent, null or ``custom`` (any other is a server tool: 400)."""
    schema["properties"]["type"] = {
        "anyOf": [{"enum": ["custom"]}, _NULL],
        "default": None,
        "description": "custom (client) tools only: kvserve runs no server tools",
    }


SYSTEM: dict[str, Any] = {"anyOf": [_STR, {"type": "array", "items": TEXT}, _NULL]}
EFFORT: dict[str, Any] = {
    "anyOf": [{"enum": ["high"]}, _NULL],
    "description": "Anthropic's default, 'high', only: kvserve cannot change the effort",
}
CONTEXT_MANAGEMENT: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "edits": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"type": "string", "pattern": "^clear_thinking_"},
                            "keep": {"const": "all"},
                        },
                        "required": ["type", "keep"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["edits"],
        },
        _NULL,
    ],
    "description": "only clear_thinking edits keeping all thinking (they change nothing)",
}


def unsupported(what: str) -> dict[str, Any]:
    """A field kvserve refuses unless null (``UNSUPPORTED_FIELDS``)."""
    return {"type": "null", "description": f"{what}: not supported by kvserve; send null"}
