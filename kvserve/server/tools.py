"""Tool calling and chat-template options on ``/v1/chat/completions`` (vLLM's semantics).

- ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, else ``"none"``.
- ``"none"``: the tools still go to the chat template (unless
  ``--exclude-tools-when-tool-choice-none``); the output is plain content.
- ``"required"`` and a named function are guaranteed by a grammar: the output is constrained
  to a JSON schema built from the tools (``structured_outputs``), then turned into
  ``message.tool_calls``. ``required``: a JSON array of 1+ ``{"name", "parameters"}``
  objects (at most one with ``parallel_tool_calls: false``), finish reason ``tool_calls``;
  named: the function's arguments object, finish reason ``stop`` (as vLLM and OpenAI).
- ``"auto"`` needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the model
  writes freely and the parser (``kvserve/server/tool_parsers/``) finds the calls, finish
  reason ``tool_calls`` when it did.

Streams carry OpenAI's incremental ``delta.tool_calls``: a call's first delta has ``index``,
``id``, ``type`` and ``function.name``; later ones carry ``function.arguments`` fragments.
The fragments of a call add up to exactly the ``arguments`` the same output gives without
streaming.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from kvserve.server.reasoning import get_reasoning_parser
from kvserve.server.tool_parsers import (
    PartialCall,
    PartialParse,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
)
from kvserve.server.tool_parsers.hermes import call_from_object
from kvserve.server.tool_parsers.partial_json import (
    MalformedJSON,
    loads_strict,
    scan_object,
    skip_ws,
)

AUTO_TOOL_CHOICE_ERROR = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
UNTRUSTED_TEMPLATE_ERROR = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# apply_chat_template's own arguments: never taken from chat_template_kwargs (chat_template
# is, under the same trust rule as the request's chat_template field).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatOptions:
    """Server-wide chat options (``kvserve serve`` flags, vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    trust_request_chat_template: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser (kvserve/server/reasoning/)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError for an unknown name
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


# -- the chat template -------------------------------------------------------------------------
@dataclass
class ChatTemplateArgs:
    """What ``apply_chat_template`` gets besides the conversation."""

    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None  # the request's; None: --chat-template or the model's
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables


def template_args(
    options: ChatOptions,
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> ChatTemplateArgs:
    """Check a request's template fields (400s) and gather them for ``chat_prompt``."""
    kwargs = dict(chat_template_kwargs or {})
    kwargs_template = kwargs.pop("chat_template", None)
    if (chat_template is not None or kwargs_template is not None) and not (
        options.trust_request_chat_template
    ):
        raise bad_request(UNTRUSTED_TEMPLATE_ERROR, "chat_template")
    if kwargs_template is not None and not isinstance(kwargs_template, str):
        raise bad_request("chat_template_kwargs.chat_template must be a string", "chat_template")
    return ChatTemplateArgs(
        tools=tools,
        documents=documents,
        continue_final_message=continue_final_message,
        chat_template=chat_template if chat_template is not None else kwargs_template,
        kwargs={k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS},
    )


def _arguments_for_template(arguments: str | dict[str, Any], where: str) -> dict[str, Any]:
    """A history call's arguments as the dict chat templates expect (vLLM parses them too)."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():
        return {}
    try:
        value = loads_strict(arguments)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{where}.function.arguments is not a JSON object", "messages")
    return value


def template_conversation(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: ``developer`` is ``system``; content is a
    string; assistant ``tool_calls`` carry their arguments as dicts; ``tool_call_id`` and
    ``name`` are kept."""
    conv = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
        }
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: only assistant messages have tool_calls", "messages"
                )
            calls = []
            for j, tc in enumerate(m.tool_calls):
                call: dict[str, Any] = {
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": _arguments_for_template(
                            tc.function.arguments, f"messages[{i}].tool_calls[{j}]"
                        ),
                    },
                }
                if tc.id is not None:
                    call["id"] = tc.id
                calls.append(call)
            msg["tool_calls"] = calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if (thinking := m.thinking()) is not None:
            msg["reasoning"] = msg["reasoning_content"] = thinking
        conv.append(msg)
    return conv


# -- the request's tool plan -------------------------------------------------------------------
Mode = Literal["none", "auto", "required", "named"]


def _check_parameters(schema: dict[str, Any], where: str) -> None:
    """Refuse a ``parameters`` schema that is not an object schema (the grammar compiler
    checks the rest when it builds a grammar from it)."""
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise bad_request(f"{where}.parameters must be a JSON schema of type object", "tools")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise bad_request(f"{where}.parameters.properties must map names to schemas", "tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request(f"{where}.parameters.required must be a list of names", "tools")
    defs = schema.get("$defs", {})
    if not isinstance(defs, dict):
        raise bad_request(f"{where}.parameters.$defs must be an object", "tools")


def required_schema(tools: Sequence[ChatCompletionTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"`` (vLLM's): an array of 1+ (1 without
    parallel calls) ``{"name": <one tool>, "parameters": <its arguments>}`` objects; the
    tools' ``$defs`` move to the top, where their ``#/$defs/...`` references point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) or dict(_EMPTY_PARAMETERS)
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                    "tools",
                )
            defs[name] = schema
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> PartialParse:
    """The calls of a ``required`` output (``[{"name": ..., "parameters": {...}}, ...]``) as
    far as it goes; a malformed rest ends the list (never raises)."""
    parse = PartialParse("")
    pos = skip_ws(text, 0)
    if pos == len(text) or text[pos] != "[":
        return parse
    pos += 1
    try:
        while True:
            pos = skip_ws(text, pos)
            if pos == len(text) or text[pos] == "]":
                return parse
            if text[pos] == "," and parse.calls:
                pos += 1
                continue
            scan = scan_object(text, pos)
            parse.calls.append(call_from_object(text, scan, ("parameters", "arguments")))
            if scan.end is None:
                return parse
            pos = scan.end
    except (MalformedJSON, ValueError, RecursionError):
        return parse


@dataclass
class ToolPlan:
    """How one request uses its tools: the template's tools, the grammar, the output."""

    mode: Mode = "none"
    template_tools: list[dict[str, Any]] | None = None
    function_name: str | None = None  # named
    parser: type[ToolParser] | None = None  # auto
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    schema: dict[str, Any] | None = None  # required / named: the output's JSON schema

    @property
    def streams_tools(self) -> bool:
        return self.mode != "none"

    def apply_grammar(self, params: SamplingParams) -> None:
        """Constrain ``params`` to the tool-call schema (required / named)."""
        if self.schema is None:
            return
        if params.structured_outputs is not None:
            raise bad_request(
                "You can only either use structured outputs (response_format, "
                "structured_outputs, guided_*) or tools with tool_choice 'required' or a "
                "named function, not both.",
                "tool_choice",
            )
        from kvserve.structured_output import StructuredOutputsParams

        params.structured_outputs = StructuredOutputsParams(json=self.schema)

    def _partial(self, text: str) -> PartialParse:
        if self.mode == "named":
            return PartialParse("", [PartialCall(self.function_name, text)])
        parse = parse_required(text)
        for call in parse.calls:  # no more than the grammar allows
            call.complete = True
        return parse

    def message(
        self, text: str, finish_reason: str | None
    ) -> tuple[ChatResponseMessage, str | None]:
        """The non-streamed message of one choice and its finish reason."""
        if self.mode == "none":
            return ChatResponseMessage(content=text), finish_reason
        if self.mode == "auto":
            assert self.parser is not None
            info = self.parser(None, self.max_calls).extract_tool_calls(text)
            if not info.tools_called:
                return ChatResponseMessage(content=text), finish_reason
            return ChatResponseMessage(
                content=info.content, tool_calls=info.tool_calls
            ), "tool_calls"
        calls = [c for c in self._partial(text).calls if c.name is not None][: self.max_calls]
        if not calls:  # a required output cut before its first name
            return ChatResponseMessage(content=text), finish_reason
        tool_calls = [
            ToolCall(function=FunctionCall(name=c.name or "", arguments=c.arguments)) for c in calls
        ]
        if self.mode == "required" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChatResponseMessage(content=None, tool_calls=tool_calls), finish_reason

    def streamer(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


class ChoiceToolStream:
    """The deltas of one streamed choice of a request with tools."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser(None, plan.max_calls) if plan.parser is not None else None
        self.streamer = self.parser.streamer if self.parser else ToolCallStreamer(plan.max_calls)
        self.prev_text = ""

    def step(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The ``delta`` of the chunk for the output so far (``{}``: nothing new) and the
        finish reason to send with it."""
        if self.parser is not None:
            delta = self.parser.extract_tool_calls_streaming(
                self.prev_text, text, text[len(self.prev_text) :]
            )
            self.prev_text = text
            if finish_reason is not None:
                last, called = self.parser.finish_streaming(text)
                delta = merge_deltas(delta, last)
                if called:
                    finish_reason = "tool_calls"
        else:
            delta = self.streamer.update(self.plan._partial(text))
            if finish_reason is not None:
                if self.streamer.announced:
                    if self.plan.mode == "required" and finish_reason == "stop":
                        finish_reason = "tool_calls"
                else:  # no call at all: the text is the answer, as without streaming
                    rest = text[self.streamer.sent_content :]
                    delta = merge_deltas(delta, DeltaMessage(content=rest) if rest else None)
        return ({} if delta is None else delta.model_dump(mode="json")), finish_reason


def merge_deltas(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    """One delta saying what ``a`` then ``b`` say (fragments of one call joined)."""
    if a is None or b is None:
        return a or b
    content = (a.content or "") + (b.content or "")
    calls: dict[int, DeltaToolCall] = {}
    for tc in [*(a.tool_calls or []), *(b.tool_calls or [])]:
        if tc.index not in calls:
            calls[tc.index] = tc.model_copy(deep=True)
            continue
        into = calls[tc.index]
        into.id = into.id or tc.id
        into.type = into.type or tc.type
        if tc.function is not None:
            f = into.function or DeltaFunctionCall()
            f.name = f.name or tc.function.name
            if tc.function.arguments:
                f.arguments = (f.arguments or "") + tc.function.arguments
            into.function = f
    return DeltaMessage(content=content or None, tool_calls=list(calls.values()) or None)


def plan_tools(req: ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    """Validate the request's tool fields (400s with vLLM's messages) and plan the tools."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and req.tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools: the function name {dup!r} is given twice", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            _check_parameters(tool.function.parameters, f"tools[{i}].function")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    max_calls = None if req.parallel_tool_calls else 1
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise bad_request(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        schema = copy.deepcopy(tool.function.parameters) or dict(_EMPTY_PARAMETERS)
        return ToolPlan("named", template_tools, name, max_calls=1, schema=schema)
    if not tools or choice == "none":  # "required" with no tools acts as "none" (vLLM)
        if options.exclude_tools_when_tool_choice_none:
            template_tools = None
        return ToolPlan("none", template_tools)
    if choice == "required":
        return ToolPlan("required", template_tools, max_calls=max_calls,
                        schema=required_schema(tools, req.parallel_tool_calls))  # fmt: skip
    if not (options.enable_auto_tool_choice and options.tool_call_parser):
        raise bad_request(AUTO_TOOL_CHOICE_ERROR, "tool_choice")
    parser = get_tool_parser(options.tool_call_parser)
    return ToolPlan("auto", template_tools, parser=parser, max_calls=max_calls)


def chat_template_args(
    req: ChatCompletionRequest, plan: ToolPlan, options: ChatOptions
) -> ChatTemplateArgs:
    return template_args(
        options,
        tools=plan.template_tools,
        documents=req.documents,
        continue_final_message=req.continue_final_message,
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
    )


__all__ = [
    "AUTO_TOOL_CHOICE_ERROR",
    "ChatOptions",
    "ChatTemplateArgs",
    "ChoiceToolStream",
    "ToolPlan",
    "chat_template_args",
    "merge_deltas",
    "parse_required",
    "plan_tools",
    "required_schema",
    "template_args",
    "template_conversation",
]
