"""Request and response bodies of Anthropic's Messages API (the fields kvserve serves).

Unknown fields are ignored, as on the OpenAI routes, so newer clients keep working; fields and
block types whose meaning kvserve cannot honour (server tools, images, documents, MCP
servers...) are declared loosely and refused with a 400 naming them (``messages.py``).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.anthropic import published
from kvserve.server.protocol import INT64_END, Int


class _Request(BaseModel):
    # strict, no NaN: as kvserve's OpenAI request bodies (kvserve/server/protocol.py)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class Block(_Request):
    """One content block, any type: checked and translated by type in ``messages.py``
    (``text``, ``thinking``, ``redacted_thinking``, ``tool_use``, ``tool_result``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    type: str
    text: str | None = None  # text
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking: accepted, not checked
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class MessageParam(_Request):
    model_config = ConfigDict(json_schema_extra=published.message_by_role)

    role: Literal["user", "assistant", "system"]  # system: text only (Claude Code sends one)
    content: str | list[Block]


class Tool(_Request):
    """A client tool (``type`` absent or ``custom``); any other type is a server tool that
    kvserve cannot run (web search, code execution, bash, computer use...)."""

    model_config = ConfigDict(
        extra="allow", strict=True, allow_inf_nan=False,
        json_schema_extra=published.custom_tools_only,
    )  # fmt: skip

    type: str | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


def _tool_needs_a_name(schema: dict[str, Any]) -> None:
    """Published as two variants: ``tool`` names its tool (translate.py refuses it without)."""
    named = {
        **schema["properties"],
        "type": {"const": "tool"},
        "name": {"type": "string", "minLength": 1},
    }
    others = {**schema["properties"], "type": {"enum": ["auto", "any", "none"]}}
    schema["oneOf"] = [
        {"properties": named, "required": ["type", "name"]},
        {"properties": others, "required": ["type"]},
    ]


class ToolChoice(_Request):
    model_config = ConfigDict(json_schema_extra=_tool_needs_a_name)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # tool
    disable_parallel_tool_use: bool = False


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    # enabled: the chat side's thinking_token_budget (the end marker forced after it)
    budget_tokens: Int | None = Field(None, ge=0)
    # refused when "omitted" (translate.py), so the document offers "summarized" alone
    display: Literal["summarized", "omitted"] | None = Field(
        None, json_schema_extra={"anyOf": [{"enum": ["summarized"]}, {"type": "null"}]}
    )


class OutputFormat(_Request):
    """Anthropic's structured outputs: the answer is JSON following ``schema``."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    # only "high", Anthropic's default (translate.py)
    effort: str | None = Field(None, json_schema_extra=published.EFFORT)
    format: OutputFormat | None = None


class Metadata(_Request):
    user_id: str | None = None  # accepted; changes nothing


def _publish_fields(schema: dict[str, Any]) -> None:
    """``system`` of text blocks, and the fields read from the raw body
    (``translate.check_unsupported_fields``) with the values the server accepts."""
    props = schema["properties"]
    props["context_management"] = deepcopy(published.CONTEXT_MANAGEMENT)
    props["system"] = deepcopy(published.SYSTEM)  # text blocks only
    for name, what in published.UNSUPPORTED_FIELDS.items():
        props[name] = published.unsupported(what)


class CountTokensRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_publish_fields)

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[Block] | None = None  # published: text blocks only
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def _with_example(schema: dict[str, Any]) -> None:
    _publish_fields(schema)
    schema["examples"] = [{
        "model": "SmolLM2-135M-Instruct", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hi"}],
    }]  # fmt: skip


class MessagesRequest(CountTokensRequest):
    model_config = ConfigDict(json_schema_extra=_with_example)

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0, lt=INT64_END)
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted: one tier here
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the older (beta) spelling of output_config.format


# -- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache
    (the prefix cache's hits are ``cache_read_input_tokens``; kvserve writes no cache
    explicitly, so ``cache_creation_input_tokens`` is 0)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body (``kvserve/server/anthropic/errors.py`` writes it)."""

    type: Literal["error"] = "error"
    error: ErrorDetail
