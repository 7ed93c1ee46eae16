"""The chat request pipeline that every chat-shaped endpoint shares.

``/v1/chat/completions`` and ``/v1/messages`` (``kvserve/server/anthropic/``) are translations
at both ends of it: an endpoint turns its request into a ``ChatCompletionRequest``, calls
``start_chat`` (checks and limits, the tool plan, the chat template rendered and tokenized off
the event loop, the sampling parameters, the grammar compiled, the engine requests submitted)
and turns the engine's outputs into its own wire format with ``choice_message`` (a finished
choice) or ``ChoiceDeltas`` (a streamed one), which apply the reasoning parser first and the
tool parser to the answer after the thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.server.beam import check_beam_fields, submit_beam_search
from kvserve.server.errors import bad_request
from kvserve.server.offload import SMALL_JOB_CHARS, run_cpu
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, ChatResponseMessage
from kvserve.server.reasoning import (
    ReasoningParser,
    ReasoningStreamer,
    get_reasoning_parser,
    thinking_enabled,
)
from kvserve.server.request_limits import (
    check_chat,
    check_request_cost,
    check_tools,
)
from kvserve.server.serving import (
    Limits,
    PromptInfo,
    check_fan_out,
    check_grammar,
    is_batch_line,
    make_params,
    new_id,
    resolve_max_tokens,
    start_streams,
)
from kvserve.server.tools import (
    ChatOptions,
    ChatTemplateArgs,
    ChoiceToolStream,
    ToolPlan,
    chat_template_args,
    plan_tools,
    template_conversation,
)
from kvserve.structured_output.reasoning import ReasoningMarkers

BUDGET_WITHOUT_PARSER = (
    "thinking_token_budget needs a reasoning model served with --reasoning-parser (Messages: "
    "thinking.budget_tokens)"
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


def reasoning_for(
    req: ChatCompletionRequest, options: ChatOptions, tokenizer: Any
) -> ReasoningParser | None:
    """The request's reasoning parser: the server's, unless the request turned thinking off."""
    if options.reasoning_parser is None:
        if req.thinking_token_budget is not None:
            raise bad_request(BUDGET_WITHOUT_PARSER, "thinking_token_budget")
        return None
    if not thinking_enabled(req.chat_template_kwargs):
        return None  # no thinking: a budget has nothing to bound
    return get_reasoning_parser(options.reasoning_parser)(tokenizer)


def with_reasoning(
    params: SamplingParams, markers: ReasoningMarkers, budget: int | None
) -> SamplingParams:
    """``params`` for a request whose output thinks first (checked again: a bad budget)."""
    return replace(params, reasoning_markers=markers, thinking_token_budget=budget)


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked and rendered: its prompt and how to read its outputs."""

    prompt: PromptInfo
    tools: ToolPlan
    reasoning: ReasoningParser | None


async def plan_chat(
    req: ChatCompletionRequest, engine: AsyncLLMEngine, limits: Limits, options: ChatOptions
) -> ChatPlan:
    """Every check that needs no sampling parameters, then the prompt (``count_tokens`` and
    ``/tokenize`` stop here)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("logprobs must be true when top_logprobs is set", "top_logprobs")
    check_chat(limits, req.messages, req.documents)  # before any work on the messages
    check_tools(limits, req.tools)
    tools = plan_tools(req, options)  # tool_choice, the grammar, parsing the output
    check_fan_out(limits, req.n, 1)
    template = chat_template_args(req, tools, options)
    prompt = await chat_prompt(engine, req.messages, req.add_generation_prompt, template)
    return ChatPlan(prompt, tools, reasoning_for(req, options, engine.tokenizer))


@dataclass(frozen=True)
class ChatRun:
    """A chat request admitted to the engine."""

    request_id: str
    plan: ChatPlan
    params: SamplingParams
    streams: list[RequestStream]
    top_k: int | None  # top_logprobs when logprobs are asked, else None


async def start_chat(
    req: ChatCompletionRequest,
    raw: Request,
    engine: AsyncLLMEngine,
    limits: Limits,
    options: ChatOptions,
    request_id: str | None = None,
) -> ChatRun:
    """Check, render, build the parameters, compile the grammar and submit ``req`` (as
    ``request_id``; None: a new ``chatcmpl-`` id)."""
    if req.use_beam_search:
        check_beam_fields(req)
    plan = await plan_chat(req, engine, limits, options)
    requested = req.max_completion_tokens or req.max_tokens
    defaults = engine.default_sampling_params  # the model's (--generation-config auto)
    max_tokens = resolve_max_tokens(
        engine, len(plan.prompt.token_ids), requested, limits, defaults.get("max_tokens")
    )
    if req.use_beam_search:  # vLLM's default: the room left in the context
        room = engine.max_model_len - len(plan.prompt.token_ids)
        request_id = request_id or new_id("chatcmpl")
        streams = submit_beam_search(req, raw, engine, [plan.prompt], max_tokens or room,
                                     request_id)  # fmt: skip
        return ChatRun(request_id, plan, SamplingParams(n=req.n, temperature=0.0), streams, None)
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = make_params(req.sampling_params, max_tokens, top_k, defaults)
    plan.tools.apply_grammar(params)  # tool_choice required / named
    if plan.reasoning is not None:
        # The engine starts the grammar after the thinking and enforces the budget (vLLM's
        # rules; kvserve/structured_output/reasoning.py).
        markers = plan.reasoning.markers()
        params = make_params(with_reasoning, params, markers, req.thinking_token_budget)
    check_request_cost(limits, engine, params, req, "top_logprobs")
    await check_grammar(raw, engine, params)
    request_id = request_id or new_id("chatcmpl")
    streams = start_streams(
        engine, [plan.prompt], params, request_id, req.priority, is_batch_line(raw)
    )
    raw.app.state.kvserve.observe_streams(engine, params, streams, raw.headers)
    return ChatRun(request_id, plan, params, streams, top_k)


def choice_message(
    plan: ChatPlan, text: str, finish_reason: str | None, token_ids: Sequence[int] = ()
) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message (thinking, answer, tool calls) and its finish reason
    (``token_ids``: the output's, for token-level reasoning parsers)."""
    reasoning = None
    if plan.reasoning is not None:
        split = plan.reasoning.split(text, True, token_ids)
        reasoning, text = split.reasoning or None, split.content
    message, finish_reason = plan.tools.message(text, finish_reason)
    if reasoning is not None:
        message.reasoning = message.reasoning_content = reasoning
        message.content = message.content or None  # all thinking: no answer (vLLM's null)
    return message, finish_reason


# The keys of a streamed delta in ``DeltaMessage``'s field order.
_DELTA_KEYS = ("role", "content", "reasoning", "reasoning_content", "tool_calls")


class ChoiceDeltas:
    """One streamed choice of a request with tools or a reasoning parser: each step's
    ``delta`` (OpenAI's chat delta as a dict) and finish reason. The thinking deltas add up
    to the unary ``reasoning``; the content and tool-call deltas to its answer."""

    def __init__(self, plan: ChatPlan) -> None:
        self.reasoning = None if plan.reasoning is None else ReasoningStreamer(plan.reasoning)
        self.tools: ChoiceToolStream | None = (
            plan.tools.streamer() if plan.tools.streams_tools else None
        )
        self.sent = 0  # characters of content sent (without tools)

    def step(
        self, text: str, finish_reason: str | None, token_ids: Sequence[int] = ()
    ) -> tuple[dict[str, Any], str | None]:
        """The delta for the output ``text`` (and ``token_ids``) so far (``{}``: nothing new
        to send)."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            thinking, text = self.reasoning.step(text, finish_reason is not None, token_ids)
            if thinking:
                delta["reasoning"] = delta["reasoning_content"] = thinking
        if self.tools is not None:
            answer, finish_reason = self.tools.step(text, finish_reason)
            delta.update(answer)
        elif len(text) > self.sent:
            delta["content"] = text[self.sent :]
            self.sent = len(text)
        return {k: delta[k] for k in _DELTA_KEYS if k in delta}, finish_reason


def streams_deltas(plan: ChatPlan) -> bool:
    """Whether a stream's choices need ``ChoiceDeltas`` (else content is the new text)."""
    return plan.reasoning is not None or plan.tools.streams_tools
