"""``POST /v1/chat/completions``: the tokenizer's chat template, n choices, logprobs, SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput, TokenLogprobs
from kvserve.server.chat_pipeline import (
    ChatPlan,
    ChoiceDeltas,
    chat_prompt,
    choice_message,
    start_chat,
    streams_deltas,
)
from kvserve.server.errors import error_event
from kvserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTokenLogprob,
    TopLogprob,
)
from kvserve.server.serving import (
    SSE_DONE,
    ChunkEncoder,
    Limits,
    final_outputs,
    logprob_text,
    merge_streams,
    prompt_logprobs_json,
    run_watching_disconnect,
    sse,
    stream_error,
    token_text,
    usage_info,
)
from kvserve.server.tools import ChatOptions

__all__ = ["chat_prompt", "create_chat_completion"]  # chat_prompt: /tokenize's, re-exported

_MISSING_LOGPROB = -9999.0  # never expected: the engine always reports the sampled token


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
    run = await start_chat(req, raw, engine, limits, options or ChatOptions())
    streams, request_id, top_k = run.streams, run.request_id, run.top_k
    if req.stream:
        return StreamingResponse(
            _stream(req, engine, streams, request_id, top_k, run.plan),
            media_type="text/event-stream",
        )
    (out,) = await run_watching_disconnect(raw, final_outputs(streams))
    choices = [
        ChatCompletionChoice(
            index=c.index,
            message=(m := choice_message(run.plan, c.text, c.finish_reason, c.token_ids))[0],
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
    plan: ChatPlan,
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
    # With tools or a reasoning parser, each choice's text goes through its ChoiceDeltas
    # (reasoning, then content and tool_calls deltas).
    choice_deltas = [ChoiceDeltas(plan) for _ in range(req.n)] if streams_deltas(plan) else None
    num_prompt_tokens = len(plan.prompt.token_ids)
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
                if choice_deltas is not None:
                    delta, finish_reason = choice_deltas[i].step(
                        c.text, c.finish_reason, c.token_ids
                    )
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
