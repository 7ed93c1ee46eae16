"""``/v1/responses`` requests (OpenAI's Responses API) and their translation into chat.

A Responses request becomes a ``ChatCompletionRequest`` (``to_chat_request``) that runs the
chat pipeline unchanged (``chat_pipeline.start_chat``): ``instructions`` is a system message
first; ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call`` and ``function_call_output``) is the conversation after the stored one of
``previous_response_id``; function ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` are
chat's; ``text.format`` is ``response_format`` (the same grammar path); ``max_output_tokens``,
``temperature`` and ``top_p`` are chat's ``max_completion_tokens``, ``temperature``, ``top_p``.

What kvserve cannot honour is a 400 naming the field (``unsupported_fields``): hosted tools
(web search, file search, computer use, code interpreter, MCP...), ``background``, ``include``
of anything but ``reasoning.encrypted_content`` (there is none: reasoning, once a parser
gives it, is plain text), image / file / audio input, ``truncation: "auto"``,
``reasoning.effort`` / ``summary``, ``top_logprobs``, ``max_tool_calls``, ``prompt``,
``conversation``. Unknown fields are ignored, as on every other route. The typed items, tools
and the accepted values of those fields are what ``/openapi.json`` publishes
(``responses_items.py``); an item or tool type left out of it is refused by name on the raw
request (the ``field_validator``s below), before pydantic's union would.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    FunctionDefinition,
    Int,
    MessageFunctionCall,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from kvserve.server.responses_items import (
    BACKGROUND,
    INCLUDE,
    NULL_ONLY,
    REASONING,
    SUPPORTED_INCLUDE,
    TOP_LOGPROBS,
    TRUNCATION,
    VERBOSITY,
    FunctionTool,
    FunctionToolChoice,
    InputItem,
    text_format_variants,
)
from kvserve.server.structured import JsonSchemaFormat, ResponseFormat

_TEXT_PARTS = {
    "user": ("input_text",),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "refusal", "input_text"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    model_config = ConfigDict(
        extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra=text_format_variants
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, json_schema_extra=VERBOSITY)


class ResponsesRequest(_Strict):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra={"examples": [{"input": "Say hi", "max_output_tokens": 16}]},
    )

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None  # echoed back
    # Accepted only at the value that asks nothing kvserve cannot do (unsupported_fields)
    # (published as the accepted values only: responses_items)
    background: bool | None = Field(None, json_schema_extra=BACKGROUND)
    include: list[str] | None = Field(None, json_schema_extra=INCLUDE)
    truncation: Literal["disabled", "auto"] | None = Field(None, json_schema_extra=TRUNCATION)
    reasoning: dict[str, Any] | None = Field(None, json_schema_extra=REASONING)
    top_logprobs: Int | None = Field(None, json_schema_extra=TOP_LOGPROBS)
    max_tool_calls: Int | None = Field(None, json_schema_extra=NULL_ONLY)
    prompt: dict[str, Any] | None = Field(None, json_schema_extra=NULL_ONLY)
    conversation: str | dict[str, Any] | None = Field(None, json_schema_extra=NULL_ONLY)

    # The raw items first, for the clear 400s of the types and parts kvserve does not read
    # (the published schema leaves them out; pydantic's union error would not name them).
    @field_validator("input", mode="before")
    @classmethod
    def _readable_input(cls, value: Any) -> Any:
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            input_messages(value)
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            if isinstance(tool, dict) and tool.get("type") != "function":
                _hosted_tool(i, tool.get("type"))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_function(cls, value: Any) -> Any:
        if isinstance(value, dict) and not (
            value.get("type") == "function" and isinstance(value.get("name"), str)
        ):
            raise bad_request(
                f"tool_choice {value!r} is not supported: give 'none', 'auto', 'required' or "
                "{'type': 'function', 'name': ...}",
                "tool_choice",
            )
        return value

    @property
    def stores(self) -> bool:
        return self.store is not False


def unsupported_fields(req: ResponsesRequest) -> None:
    """400 naming the first field whose value kvserve cannot honour."""
    if req.background:
        _refuse("background", "background responses are not supported; leave background unset")
    for value in req.include or ():
        if value not in SUPPORTED_INCLUDE:
            _refuse(
                "include",
                f"include {value!r} is not supported (kvserve answers only "
                f"{', '.join(sorted(SUPPORTED_INCLUDE))})",
            )
    if req.truncation == "auto":
        _refuse(
            "truncation",
            "truncation 'auto' is not supported; a prompt longer than the "
            "context is a 400 (truncation 'disabled')",
        )
    for key, value in (req.reasoning or {}).items():
        if value is not None:  # SEAM(reasoning): effort/summary for --reasoning-parser models
            _refuse(f"reasoning.{key}", f"reasoning.{key} is not supported by this server")
    if req.top_logprobs:
        _refuse(
            "top_logprobs",
            "top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
        )
    for name in ("max_tool_calls", "prompt", "conversation"):
        if getattr(req, name) is not None:
            _refuse(name, f"{name} is not supported by this server")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        _refuse("text.verbosity", "text.verbosity other than 'medium' is not supported")


def _refuse(param: str, message: str) -> None:
    raise bad_request(message, param)


def _text_of(content: Any, role: str, where: str) -> str:
    """A message's content (a string or text parts) as one string (parts joined by newlines,
    as chat's text parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS[role]:
            raise bad_request(
                f"{where}.content[{j}]: part type {kind!r} is not supported in a {role} message "
                f"(kvserve reads {', '.join(_TEXT_PARTS[role])})",
                "input",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}] has no text", "input")
        texts.append(text)
    return "\n".join(texts)


def _call_output(item: dict[str, Any], where: str) -> str:
    output = item.get("output")
    if isinstance(output, list):  # a list of input_text parts
        return _text_of(output, "user", where)
    if not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string", "input")
    return output


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return value


def input_messages(items: str | list[dict[str, Any]] | list[InputItem]) -> list[ChatMessage]:
    """``input`` as chat messages: consecutive ``function_call`` items join one assistant
    message's ``tool_calls`` (the assistant text just before them too); ``reasoning`` items
    are dropped (chat templates leave earlier turns' thinking out). Raw items (dicts) are
    checked here too, for ``ResponsesRequest``'s validator."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for i, given in enumerate(items):
        item = given.model_dump() if isinstance(given, BaseModel) else given
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _TEXT_PARTS:
                raise bad_request(
                    f"{where}.role {role!r} is not one of {list(_TEXT_PARTS)}", "input"
                )
            messages.append(
                ChatMessage(role=role, content=_text_of(item.get("content"), role, where))
            )
        elif kind == "function_call":
            call = MessageToolCall(
                id=_string(item, "call_id", where),
                function=MessageFunctionCall(
                    name=_string(item, "name", where), arguments=_string(item, "arguments", where)
                ),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(
                ChatMessage(
                    role="tool",
                    content=_call_output(item, where),
                    tool_call_id=_string(item, "call_id", where),
                )
            )
        elif kind == "reasoning":
            continue  # SEAM(reasoning): a template that shows past thinking would get it here
        else:
            raise bad_request(
                f"{where}: input item type {kind!r} is not supported (kvserve reads "
                "message, function_call, function_call_output, reasoning)",
                "input",
            )
    return messages


def _hosted_tool(i: int, kind: Any) -> None:
    raise bad_request(
        f"tools[{i}]: tool type {kind!r} is not supported: kvserve runs no hosted tools "
        "(web search, file search, computer use, code interpreter, MCP...), only "
        "function tools that the client runs",
        "tools",
    )


def chat_tools(tools: list[FunctionTool] | None) -> list[ChatCompletionTool] | None:
    """Function tools as chat's (``ResponsesRequest`` refused any other type)."""
    if tools is None:
        return None
    keys = {"name", "description", "parameters", "strict"}
    return [
        ChatCompletionTool(function=FunctionDefinition(**tool.model_dump(include=keys)))
        for tool in tools
    ]


def chat_tool_choice(choice: str | FunctionToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad_request("text.format json_schema needs a schema", "text.format")
    schema = JsonSchemaFormat(name=fmt.name, schema=fmt.json_schema, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


def to_chat_request(
    req: ResponsesRequest, history: list[ChatMessage], new: list[ChatMessage]
) -> ChatCompletionRequest:
    """The chat request that answers ``req``: the instructions, the stored ``history`` of
    ``previous_response_id``, then this request's ``new`` messages."""
    system = (
        [] if req.instructions is None else [ChatMessage(role="system", content=req.instructions)]
    )
    if not (system or history or new):  # input of reasoning items only
        raise bad_request(
            "input has nothing to answer: give instructions, a previous_response_id or an "
            "item besides reasoning items",
            "input",
        )
    try:
        return ChatCompletionRequest(
            model=req.model,
            messages=[*system, *history, *new],
            tools=chat_tools(req.tools),
            tool_choice=chat_tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            response_format=response_format(req.text),
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
        )
    except APIError:
        raise
    except ValueError as e:  # pydantic's (min_length of messages...)
        raise bad_request(str(e), "input") from e


# The chat request's fields, as a Responses client knows them (for the 400s' ``param``)
RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
