"""The typed parts of a ``/v1/responses`` request: ``input`` items, function ``tools`` and a
named ``tool_choice``, and the JSON schemas of the fields kvserve accepts only at a neutral
value (``responses_protocol.unsupported_fields`` refuses the others).

These models are what ``/openapi.json`` publishes, so that a request built from the document
is one kvserve serves (tests/server/test_schemathesis.py). The item types kvserve does not
read (images, files, hosted tools' calls...) are left out of the document; a request that
sends one is refused before these models see it, by ``responses_protocol``'s checks on the
raw items, with a 400 naming the type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


AssistantPart = Annotated[InputText | OutputText | RefusalPart, Field(discriminator="type")]


class InputMessage(_Strict):
    """A user, system or developer turn: a string, or ``input_text`` parts."""

    type: Literal["message"] = "message"  # optional, as OpenAI's easy input messages
    role: Literal["user", "system", "developer"]
    content: str | list[InputText]


class AssistantMessage(_Strict):
    """An earlier assistant turn: a string, or ``output_text`` / ``refusal`` parts."""

    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: str | list[AssistantPart]


class FunctionCallItem(_Strict):
    """A call the model made earlier (joins the assistant turn's ``tool_calls``)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


class FunctionCallOutputItem(_Strict):
    """What the client's function returned (a ``tool`` message)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningItem(_Strict):
    """Earlier thinking: accepted and left out of the prompt, as chat templates do."""

    type: Literal["reasoning"]


def _item_kind(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
    return "assistant" if kind == "message" and role == "assistant" else kind


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Strict):
    """A function the client runs (kvserve runs no hosted tools)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


SUPPORTED_INCLUDE = ("reasoning.encrypted_content",)  # reasoning is plain text: there is none


def _only(*arms: dict[str, Any], why: str) -> Any:
    """A ``json_schema_extra`` that publishes exactly ``arms`` (or null) for a field whose
    type is wider so that ``unsupported_fields`` can name what it refuses."""

    def publish(schema: dict[str, Any]) -> None:
        schema.clear()
        schema.update(anyOf=[*arms, {"type": "null"}], default=None, description=why)

    return publish


BACKGROUND = _only({"type": "boolean", "enum": [False]}, why="background responses: not supported")
INCLUDE = _only(
    {"type": "array", "items": {"type": "string", "enum": list(SUPPORTED_INCLUDE)}},
    why="only reasoning.encrypted_content (empty: reasoning is plain text)",
)
TRUNCATION = _only({"type": "string", "enum": ["disabled"]}, why="'auto' is not supported")
REASONING = _only(
    {"type": "object", "additionalProperties": {"type": "null"}},
    why="effort and summary are not supported; null only",
)
TOP_LOGPROBS = _only({"type": "integer", "enum": [0]}, why="use /v1/chat/completions")
NULL_ONLY = _only(why="not supported; send null")
VERBOSITY = _only({"type": "string", "enum": ["medium"]}, why="only 'medium'")


def text_format_variants(schema: dict[str, Any]) -> None:
    """``text.format`` as two variants: a ``json_schema`` format carries its ``schema`` (an
    object; ``response_format`` refuses it otherwise), the others need none."""
    props = schema.pop("properties")
    schema.pop("required", None)
    schema.pop("type", None)
    plain = {**props, "type": {"type": "string", "enum": ["text", "json_object"]}}
    given = {**props, "type": {"type": "string", "const": "json_schema"}}
    given["schema"] = {"type": "object"}
    schema["oneOf"] = [
        {"type": "object", "properties": plain, "required": ["type"]},
        {"type": "object", "properties": given, "required": ["type", "schema"]},
    ]
