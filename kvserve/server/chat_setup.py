"""The admission of one chat request, shared by every endpoint that speaks chat to the engine.

``/v1/chat/completions`` (``chat.py``) and ``/v1/responses`` (``responses.py``, which first
translates its request into a ``ChatCompletionRequest``) both go through ``start_chat``: the
cost limits, the tool plan, the chat template and tokenizer (off the event loop), the
``max_tokens`` room, the sampling parameters, the grammar (compiled before the engine sees
the request), then one engine request per prompt. What each endpoint adds is the translation
of its own request before and of the engine's outputs after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.offload import SMALL_JOB_CHARS, run_cpu
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage
from kvserve.server.request_limits import check_chat, check_request_cost, check_tools
from kvserve.server.serving import (
    Limits,
    PromptInfo,
    check_fan_out,
    check_grammar,
    make_params,
    new_id,
    resolve_max_tokens,
    start_streams,
)
from kvserve.server.tools import (
    ChatOptions,
    ChatTemplateArgs,
    ToolPlan,
    chat_template_args,
    plan_tools,
    template_conversation,
)


async def chat_prompt(
    engine: AsyncLLMEngine,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    template: ChatTemplateArgs | None = None,
) -> PromptInfo:
    """Render the conversation with the model's chat template and tokenize it.

    ``template``: the tools, documents, ``continue_final_message``, the request's template
    and extra variables (``kvserve/server/tools.py``, already checked).
    """
    tok = engine.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer, so it has no chat template", "messages")
    # "developer" is OpenAI's newer name for the system role; templates know only "system".
    conv = template_conversation(messages)
    args = template or ChatTemplateArgs()

    def render() -> PromptInfo:
        text = tok.apply_chat_template(
            conv,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=args.continue_final_message,
            tools=args.tools,
            documents=args.documents,
            # the request's (trusted), else --chat-template, else the tokenizer's own
            chat_template=args.chat_template or engine.config.model.chat_template,
            **args.kwargs,
        )
        # The template already holds the special tokens: do not add BOS again.
        return PromptInfo(text, tok.encode(text, add_special_tokens=False))

    # Off the event loop whatever the conversation's size (request_limits bounds it); tools,
    # documents and a request's own template make a render larger than its messages.
    small = sum(len(m["content"]) for m in conv) <= SMALL_JOB_CHARS and not (
        args.tools or args.documents or args.chat_template
    )
    try:
        return await run_cpu(render, small)
    except Exception as e:  # jinja errors (e.g. a template that rejects the roles given)
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from e


@dataclass(frozen=True)
class ChatRun:
    """An admitted chat request: its engine streams and what reading them needs."""

    request_id: str
    prompt: PromptInfo
    params: SamplingParams
    tools: ToolPlan
    top_k: int | None  # top logprobs per token (None: no logprobs)
    streams: list[RequestStream]


async def start_chat(
    req: ChatCompletionRequest,
    raw: Request,
    engine: AsyncLLMEngine,
    limits: Limits,
    options: ChatOptions,
    id_prefix: str = "chatcmpl",
) -> ChatRun:
    """Validate, render and submit ``req``; 400s (``APIError``) before any engine work."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("logprobs must be true when top_logprobs is set", "top_logprobs")
    check_chat(limits, req.messages, req.documents)  # before any work on the messages
    check_tools(limits, req.tools)
    tools = plan_tools(req, options)  # tool_choice, the grammar, parsing the output
    check_fan_out(limits, req.n, 1)
    template = chat_template_args(req, tools, options)
    prompt = await chat_prompt(engine, req.messages, req.add_generation_prompt, template)
    requested = req.max_completion_tokens or req.max_tokens
    defaults = engine.default_sampling_params  # the model's (--generation-config auto)
    max_tokens = resolve_max_tokens(
        engine, len(prompt.token_ids), requested, limits, defaults.get("max_tokens")
    )
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = make_params(req.sampling_params, max_tokens, top_k, defaults)
    tools.apply_grammar(params)  # tool_choice required / named
    check_request_cost(limits, engine, params, req, "top_logprobs")
    await check_grammar(raw, engine, params)
    request_id = new_id(id_prefix)
    streams = start_streams(engine, [prompt], params, request_id, req.priority)
    raw.app.state.kvserve.observe_streams(engine, params, streams, raw.headers)
    return ChatRun(request_id, prompt, params, tools, top_k, streams)
