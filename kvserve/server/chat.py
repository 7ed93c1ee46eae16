"""``POST /v1/chat/completions``: the tokenizer's chat template, n choices, logprobs, SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput, TokenLogprobs
from kvserve.server.errors import bad_request, error_event
from kvserve.server.offload import SMALL_JOB_CHARS, run_cpu
from kvserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from kvserve.server.request_limits import check_chat, check_request_cost, check_tools
from kvserve.server.serving import (
    SSE_DONE,
    ChunkEncoder,
    Limits,
    PromptInfo,
    check_fan_out,
    check_grammar,
    final_outputs,
    logprob_text,
    make_params,
    merge_streams,
    new_id,
    prompt_logprobs_json,
    resolve_max_tokens,
    run_watching_disconnect,
    sse,
    start_streams,
    stream_error,
    token_text,
    usage_info,
)
from kvserve.server.tools import (
    ChatOptions,
    ChatTemplateArgs,
    ToolPlan,
    chat_template_args,
    plan_tools,
    template_conversation,
)

_MISSING_LOGPROB = -9999.0  # never expected: the engine always reports the sampled token


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


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("logprobs must be true when top_logprobs is set", "top_logprobs")


def _logprobs(
    tok: Any, ids: Sequence[int], lps: Sequence[TokenLogprobs], k: int
) -> ChatChoiceLogprobs:
    content = []
    for tid, top in zip(ids, lps, strict=False):
        own = top.get(tid)
        text = token_text(tok, tid) if own is None else logprob_text(tok, tid, own)
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:k]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_MISSING_LOGPROB if own is None else own.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(s := logprob_text(tok, t, v)),
                        logprob=v.logprob,
                        bytes=list(s.encode()),
                    )
                    for t, v in ranked
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


async def create_chat_completion(
    req: ChatCompletionRequest,
    raw: Request,
    engine: AsyncLLMEngine,
    limits: Limits,
    options: ChatOptions | None = None,
) -> Response:
    _check_unsupported(req)
    check_chat(limits, req.messages, req.documents)  # before any work on the messages
    check_tools(limits, req.tools)
    options = options or ChatOptions()
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
    request_id = new_id("chatcmpl")
    streams = start_streams(engine, [prompt], params, request_id, req.priority)
    raw.app.state.kvserve.observe_streams(engine, params, streams, raw.headers)
    if req.stream:
        return StreamingResponse(
            _stream(req, engine, streams, request_id, top_k, tools, len(prompt.token_ids)),
            media_type="text/event-stream",
        )
    (out,) = await run_watching_disconnect(raw, final_outputs(streams))
    choices = [
        ChatCompletionChoice(
            index=c.index,
            message=(m := tools.message(c.text, c.finish_reason))[0],
            logprobs=_choice_logprobs(engine, c, 0, top_k),
            finish_reason=m[1],
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if req.return_token_ids else None,
        )
        for c in out.outputs
    ]
    body = ChatCompletionResponse(
        id=request_id,
        model=engine.model_name,
        choices=choices,
        usage=usage_info([out]),
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )
    return Response(body.model_dump_json(), media_type="application/json")


def _choice_logprobs(
    engine: AsyncLLMEngine, c: CompletionOutput, start: int, top_k: int | None
) -> ChatChoiceLogprobs | None:
    if top_k is None or c.logprobs is None:
        return None
    return _logprobs(engine.tokenizer, c.token_ids[start:], c.logprobs[start:], top_k)


async def _stream(
    req: ChatCompletionRequest,
    engine: AsyncLLMEngine,
    streams: Sequence[RequestStream],
    request_id: str,
    top_k: int | None,
    tools: ToolPlan | None = None,
    num_prompt_tokens: int = 0,
) -> AsyncIterator[str]:
    """SSE: a role chunk per choice, content deltas, finish chunks, usage (if asked), [DONE].

    With ``include_usage`` every chunk carries ``usage: null`` and one last chunk with empty
    ``choices`` carries the totals, as OpenAI's spec says; without it there is no usage key.
    Chunks are built as plain dicts in the pydantic models' field order (``ChatStreamChoice``,
    ``DeltaMessage`` without its None fields): see ``ChunkEncoder``.
    """
    enc = ChunkEncoder(request_id, "chat.completion.chunk", engine.model_name, req.include_usage)
    return_ids = req.return_token_ids
    sent_chars = [0] * req.n
    sent_tokens = [0] * req.n
    done = [False] * req.n
    # With tools, each choice's text goes through its tool stream (tool_calls deltas).
    tool_streams = None
    if tools is not None and tools.streams_tools:
        tool_streams = [tools.streamer() for _ in range(req.n)]
    # continuous_usage_stats: every chunk carries (prompt, this choice's tokens so far), vLLM's
    continuous = req.continuous_usage
    merged = merge_streams(streams)
    try:
        for i in range(req.n):
            yield enc.choice(
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                },
                (num_prompt_tokens, 0) if continuous else None,
            )
        usage = None
        async for _, out in merged:
            for c in out.outputs:
                i = c.index
                text = c.text[sent_chars[i] :]
                if done[i] or (not text and c.finish_reason is None):
                    continue  # tokens without text yet wait for the next chunk
                delta, finish_reason = ({"content": text} if text else {}), c.finish_reason
                if tool_streams is not None:
                    delta, finish_reason = tool_streams[i].step(c.text, c.finish_reason)
                    if not delta and finish_reason is None:
                        continue  # held back (a call's name is not complete yet, say)
                logprobs = _choice_logprobs(engine, c, sent_tokens[i], top_k)
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": delta,
                    "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if return_ids:
                    choice["token_ids"] = c.token_ids[sent_tokens[i] :]
                yield enc.choice(
                    choice, (num_prompt_tokens, len(c.token_ids)) if continuous else None
                )
                sent_chars[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                done[i] = c.finish_reason is not None
            if out.finished:
                usage = usage_info([out])
        if req.include_usage and usage is not None:
            yield sse(
                ChatCompletionChunk(
                    id=request_id, created=enc.created, model=enc.model, choices=[], usage=usage
                )
            )
    except Exception as e:
        yield error_event(stream_error(e))
    finally:
        await merged.aclose()
    yield SSE_DONE
