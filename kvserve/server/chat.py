"""``POST /v1/chat/completions``: the tokenizer's chat template, n choices, logprobs, SSE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput
from kvserve.server.errors import bad_request, error_event
from kvserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from kvserve.server.serving import (
    SSE_DONE,
    ChunkEncoder,
    Limits,
    PromptInfo,
    check_fan_out,
    final_outputs,
    make_params,
    merge_streams,
    new_id,
    resolve_max_tokens,
    run_watching_disconnect,
    sse,
    start_streams,
    stream_error,
    token_text,
    usage_info,
)

_MISSING_LOGPROB = -9999.0  # never expected: the engine always reports the sampled token


async def chat_prompt(
    engine: AsyncLLMEngine, messages: Sequence[ChatMessage], add_generation_prompt: bool
) -> PromptInfo:
    """Render the conversation with the model's chat template and tokenize it."""
    tok = engine.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer, so it has no chat template", "messages")
    # "developer" is OpenAI's newer name for the system role; templates know only "system".
    conv = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]

    def render() -> PromptInfo:
        text = tok.apply_chat_template(
            conv,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            # --chat-template; None keeps the tokenizer's own template
            chat_template=engine.engine.config.model.chat_template,
        )
        # The template already holds the special tokens: do not add BOS again.
        return PromptInfo(text, tok.encode(text, add_special_tokens=False))

    try:
        return await asyncio.to_thread(render) if len(conv) > 32 else render()
    except Exception as e:  # jinja errors (e.g. a template that rejects the roles given)
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from e


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("logprobs must be true when top_logprobs is set", "top_logprobs")


def _logprobs(
    tok: Any, ids: Sequence[int], lps: Sequence[dict[int, float]], k: int
) -> ChatChoiceLogprobs:
    content = []
    for tid, top in zip(ids, lps, strict=False):
        text = token_text(tok, tid)
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=top.get(tid, _MISSING_LOGPROB),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(s := token_text(tok, t)), logprob=v, bytes=list(s.encode()))
                    for t, v in ranked
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    _check_unsupported(req)
    check_fan_out(limits, req.n, 1)
    prompt = await chat_prompt(engine, req.messages, req.add_generation_prompt)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = resolve_max_tokens(engine, len(prompt.token_ids), requested, limits)
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = make_params(req.sampling_params, max_tokens, top_k)
    request_id = new_id("chatcmpl")
    streams = start_streams(engine, [prompt], params, request_id, req.priority)
    if req.stream:
        return StreamingResponse(
            _stream(req, engine, streams, request_id, top_k), media_type="text/event-stream"
        )
    (out,) = await run_watching_disconnect(raw, final_outputs(streams))
    choices = [
        ChatCompletionChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_choice_logprobs(engine, c, 0, top_k),
            finish_reason=c.finish_reason,
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
                }
            )
        usage = None
        async for _, out in merged:
            for c in out.outputs:
                i = c.index
                text = c.text[sent_chars[i] :]
                if done[i] or (not text and c.finish_reason is None):
                    continue  # tokens without text yet wait for the next chunk
                logprobs = _choice_logprobs(engine, c, sent_tokens[i], top_k)
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": {"content": text} if text else {},
                    "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if return_ids:
                    choice["token_ids"] = c.token_ids[sent_tokens[i] :]
                yield enc.choice(choice)
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
