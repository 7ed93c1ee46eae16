"""Anthropic's request, translated into the chat pipeline's ``ChatCompletionRequest``.

- ``system`` (a string or text blocks) is the first message, role ``system``; a message of
  role ``system`` inside ``messages`` (Claude Code sends one) is a ``system`` message there;
- a user message's ``text`` blocks are its content; each ``tool_result`` block becomes a
  ``tool`` message answering ``tool_use_id`` (``is_error``: its text is prefixed ``Error: ``);
- an assistant message's ``text`` blocks are its content, ``tool_use`` blocks its
  ``tool_calls``, ``thinking`` blocks its ``reasoning`` (chat templates that show earlier
  thinking read it); ``redacted_thinking`` (Anthropic-encrypted) is dropped;
- a conversation ending with an assistant message is continued (Anthropic's prefill:
  ``continue_final_message``);
- custom ``tools`` are functions with ``input_schema`` as their parameters; ``tool_choice``
  auto / any / tool / none is auto / required / the named function / none, and
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
- ``thinking`` disabled / enabled is ``chat_template_kwargs.enable_thinking`` false / true,
  and enabled's ``budget_tokens`` is ``thinking_token_budget`` (the engine forces the end of
  the thinking after that many tokens; Anthropic's own floor of 1,024 is not imposed);
- ``stop_sequences``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` keep their
  meaning under the chat names;
- ``output_config.format`` (or the older ``output_format``) ``json_schema`` is
  ``response_format`` ``json_schema``: the answer is constrained by the grammar path.

Anything kvserve cannot honour is a 400 naming it: server tools (web search, code execution,
bash, text editor, computer use...), image / document / search-result blocks, MCP servers,
containers, context edits that would change the prompt (``clear_thinking`` keeping all is
accepted: it changes nothing), ``output_config.effort`` other than the default ``high``,
``thinking.display: omitted``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvserve.server.anthropic.protocol import (
    Block,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    Tool,
)
from kvserve.server.anthropic.published import UNSUPPORTED_FIELDS
from kvserve.server.errors import bad_request, validation_message
from kvserve.server.protocol import ChatCompletionRequest

_USER_BLOCKS = ("text", "tool_result")
# output_config.effort: Anthropic's default level is accepted (it asks for nothing different);
# other levels would change how much the model thinks, which kvserve cannot do
DEFAULT_EFFORT = "high"
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def check_unsupported_fields(body: dict[str, Any]) -> None:
    for name, what in UNSUPPORTED_FIELDS.items():
        if body.get(name) is not None:
            raise bad_request(f"{name}: {what} is not supported by kvserve", name)
    _check_context_management(body.get("context_management"))


def _check_context_management(value: Any) -> None:
    """Context edits change the prompt, so only those that change nothing pass: Claude Code
    sends ``{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}`` with every
    request (keep all earlier thinking: what kvserve does). Anything else is a 400."""
    if value is None:
        return
    edits = value.get("edits") if isinstance(value, dict) else None
    if isinstance(edits, list) and all(
        isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking_")
        and e.get("keep") == "all" and set(e) <= {"type", "keep"}
        for e in edits
    ):  # fmt: skip
        return
    raise bad_request(
        "context_management: context edits (clearing old tool results or thinking) are not "
        'supported by kvserve; only clear_thinking edits with keep "all" (no change) are',
        "context_management",
    )


def _block_text(block: Block, where: str) -> str:
    if block.text is None:
        raise bad_request(f"{where}: a text block needs 'text'", "messages")
    return block.text


def _tool_result_text(block: Block, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, b in enumerate(content):
            if b.type != "text":
                raise bad_request(
                    f"{where}.content[{k}]: tool_result blocks of type {b.type!r} are not "
                    "supported by kvserve (text only)",
                    "messages",
                )
            parts.append(_block_text(b, f"{where}.content[{k}]"))
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _user_messages(m: MessageParam, i: int) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type not in _USER_BLOCKS:
            raise _unsupported_block(b, where, "user", _USER_BLOCKS)
        if b.type == "text":
            texts.append({"type": "text", "text": _block_text(b, where)})
            continue
        if b.tool_use_id is None:
            raise bad_request(f"{where}: a tool_result block needs 'tool_use_id'", "messages")
        if texts:  # text before a result keeps its place
            out.append({"role": "user", "content": texts})
            texts = []
        out.append(
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result_text(b, where)}
        )
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant_message(m: MessageParam, i: int) -> dict[str, Any]:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type not in _ASSISTANT_BLOCKS:
            raise _unsupported_block(b, where, "assistant", _ASSISTANT_BLOCKS)
        if b.type == "text":
            texts.append({"type": "text", "text": _block_text(b, where)})
        elif b.type == "thinking":
            if b.thinking is None:
                raise bad_request(f"{where}: a thinking block needs 'thinking'", "messages")
            thinking.append(b.thinking)
        elif b.type == "tool_use":
            if b.id is None or not b.name or b.input is None:
                raise bad_request(
                    f"{where}: a tool_use block needs 'id', 'name' and 'input'", "messages"
                )
            calls.append({"id": b.id, "function": {"name": b.name, "arguments": b.input}})
    msg: dict[str, Any] = {"role": "assistant", "content": texts}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning"] = "\n".join(thinking)
    return msg


def _unsupported_block(b: Block, where: str, role: str, allowed: tuple[str, ...]) -> Exception:
    return bad_request(
        f"{where}: content blocks of type {b.type!r} are not supported by kvserve in {role} "
        f"messages (supported: {', '.join(allowed)})",
        "messages",
    )


def _system(system: str | list[Block] | None, where: str = "system") -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    param = where.split("[")[0]
    for k, b in enumerate(system):
        if b.type != "text":
            raise bad_request(f"{where}[{k}]: system blocks must be text, not {b.type!r}", param)
    texts = [
        {"type": "text", "text": _block_text(b, f"{where}[{k}]")} for k, b in enumerate(system)
    ]
    return [{"role": "system", "content": texts}]


def _tool(tool: Tool, k: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"tools[{k}]: the server tool {tool.type!r} ({tool.name!r}) is not supported by "
            "kvserve: it cannot run tools itself; send custom tools (name, input_schema)",
            "tools",
        )
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.input_schema is not None:
        function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(req: CountTokensRequest, chat: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice: type 'tool' needs the tool's 'name'", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False


def _output_format(req: MessagesRequest, chat: dict[str, Any]) -> None:
    config = req.output_config
    if config is not None and config.effort not in (None, DEFAULT_EFFORT):
        raise bad_request(
            f"output_config.effort {config.effort!r} is not supported by kvserve (only "
            f"{DEFAULT_EFFORT!r}, Anthropic's default, which changes nothing)",
            "output_config",
        )
    fmt = config.format if config is not None and config.format is not None else None
    if fmt is not None and req.output_format is not None:
        raise bad_request("give output_config.format or output_format, not both", "output_format")
    fmt = fmt or req.output_format
    if fmt is not None:
        schema = {"name": "output", "schema": fmt.json_schema}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}


def to_chat_request(req: CountTokensRequest, thinks: bool = True) -> ChatCompletionRequest:
    """The chat request that means what ``req`` means (400 for what it cannot say).
    ``thinks``: the server has a reasoning parser; without one a thinking budget bounds
    nothing (the model does not think) and is dropped, as agents send it unasked."""
    messages = _system(req.system)
    for i, m in enumerate(req.messages):
        if m.role == "user":
            messages.extend(_user_messages(m, i))
        elif m.role == "system":  # a system message inside the conversation (Claude Code's)
            content = m.content if isinstance(m.content, str) else list(m.content)
            messages.extend(_system(content, f"messages[{i}].content"))
        else:
            messages.append(_assistant_message(m, i))
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.messages[-1].role == "assistant":  # prefill: the model continues that text
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if req.tools is not None:
        chat["tools"] = [_tool(t, k) for k, t in enumerate(req.tools)]
    _tool_choice(req, chat)
    if req.thinking is not None and req.thinking.type != "adaptive":
        chat["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if thinks and req.thinking is not None and req.thinking.type == "enabled":
        chat["thinking_token_budget"] = req.thinking.budget_tokens
    if req.thinking is not None and req.thinking.display == "omitted":
        raise bad_request("thinking.display 'omitted' is not supported by kvserve", "thinking")
    if isinstance(req, MessagesRequest):
        _output_format(req, chat)
        chat.update(max_tokens=req.max_tokens, stream=req.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # e.g. a tool name the chat side refuses
        message, param = validation_message(e)
        raise bad_request(message, param) from e
