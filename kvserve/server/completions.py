"""``POST /v1/completions``: several prompts, n completions each, legacy logprobs, echo, SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import bad_request, error_event
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
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
    tokenize,
    usage_info,
)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must be unset or equal to n", "best_of")
    if req.echo and req.logprobs is not None:
        # OpenAI would return the prompt's logprobs, which the engine does not compute.
        raise bad_request("echo together with logprobs is not supported", "echo")


def _prompt_items(prompt: Any) -> list[Any]:
    """The four prompt forms as a list of prompts (each a string or a list of token ids)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # one prompt of token ids
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    return items


async def _prompts(engine: AsyncLLMEngine, items: list[Any]) -> list[PromptInfo]:
    """(text, token ids) per prompt."""
    out = []
    for p in items:
        if isinstance(p, str):
            out.append(PromptInfo(p, await tokenize(engine, p)))
        else:
            out.append(PromptInfo(None, list(p)))
    return out


def _logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], offset: int
) -> CompletionLogProbs:
    """OpenAI's legacy format; ``offset`` is the text offset of the first token."""
    lp = CompletionLogProbs()
    for tid, top in zip(token_ids, logprobs, strict=False):
        text = token_text(tokenizer, tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(top.get(tid))
        lp.text_offset.append(offset)
        offset += len(text)
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        lp.top_logprobs.append({token_text(tokenizer, t): v for t, v in ranked})
    return lp


def _prompt_text(engine: AsyncLLMEngine, p: PromptInfo) -> str:
    if p.text is not None:
        return p.text
    return engine.tokenizer.decode(p.token_ids) if engine.tokenizer is not None else ""


async def create_completion(
    req: CompletionRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    _check_unsupported(req)
    items = _prompt_items(req.prompt)
    check_fan_out(limits, req.n, len(items))
    prompts = await _prompts(engine, items)
    # One SamplingParams for all prompts: the smallest resolved max_tokens fits every prompt.
    resolved = [
        resolve_max_tokens(engine, len(p.token_ids), req.max_tokens, limits) for p in prompts
    ]
    max_tokens = None if resolved[0] is None else min(r for r in resolved if r is not None)
    params = make_params(req.sampling_params, max_tokens, req.logprobs)
    request_id = new_id("cmpl")
    streams = start_streams(engine, prompts, params, request_id, req.priority)
    if req.stream:
        return StreamingResponse(
            _stream(req, engine, prompts, streams, request_id), media_type="text/event-stream"
        )
    outputs = await run_watching_disconnect(raw, final_outputs(streams))
    choices = []
    for i, out in enumerate(outputs):
        echo = _prompt_text(engine, prompts[i]) if req.echo else ""
        for c in out.outputs:
            choices.append(_choice(req, engine, i * req.n + c.index, c, echo, out))
    body = CompletionResponse(
        id=request_id, model=engine.model_name, choices=choices, usage=usage_info(outputs)
    )
    return Response(body.model_dump_json(), media_type="application/json")


def _choice(
    req: CompletionRequest,
    engine: AsyncLLMEngine,
    index: int,
    c: CompletionOutput,
    echo: str,
    out: RequestOutput,
) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None and c.logprobs is not None:
        logprobs = _logprobs(engine.tokenizer, c.token_ids, c.logprobs, len(echo))
    return CompletionChoice(
        index=index,
        text=echo + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if req.return_token_ids else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
    )


class _ChoiceCursor:
    """What has been sent of one streamed choice."""

    def __init__(self, echo: str) -> None:
        self.echo = echo  # prompt text still to send (echo), sent with the first chunk
        self.num_chars = 0
        self.num_tokens = 0
        self.offset = len(echo)  # text offset of the next token, for logprobs
        self.done = False


async def _stream(
    req: CompletionRequest,
    engine: AsyncLLMEngine,
    prompts: Sequence[PromptInfo],
    streams: Sequence[RequestStream],
    request_id: str,
) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice, then usage (if asked), then ``[DONE]``.

    Cancelled by Starlette when the client goes away; closing ``merge_streams`` then aborts
    every request.
    """
    cursors = {
        i * req.n + k: _ChoiceCursor(_prompt_text(engine, p) if req.echo else "")
        for i, p in enumerate(prompts)
        for k in range(req.n)
    }
    enc = ChunkEncoder(request_id, "text_completion", engine.model_name, req.include_usage)
    finished: list[RequestOutput] = []
    merged = merge_streams(streams)
    try:
        async for i, out in merged:
            for c in out.outputs:
                choice = _delta_choice(req, engine, cursors[i * req.n + c.index], i, c)
                if choice is not None:
                    yield enc.choice(choice)
            if out.finished:
                finished.append(out)
        if req.include_usage:
            usage = CompletionResponse(
                id=request_id,
                created=enc.created,
                model=enc.model,
                choices=[],
                usage=usage_info(finished),
            )
            yield sse(usage)
    except Exception as e:
        yield error_event(stream_error(e))
    finally:
        await merged.aclose()
    yield SSE_DONE


def _delta_choice(
    req: CompletionRequest,
    engine: AsyncLLMEngine,
    cur: _ChoiceCursor,
    prompt_index: int,
    c: CompletionOutput,
) -> dict[str, Any] | None:
    """What is new in ``c`` since the last chunk, as a ``CompletionChoice``'s JSON fields (in
    its field order, ``None`` token ids left out), or None if nothing is new."""
    if cur.done:
        return None
    text = c.text[cur.num_chars :]
    # Text can lag tokens (partial UTF-8, held-back stop-string prefixes): tokens without new
    # text wait for the next chunk, so every chunk carries text or the finish reason.
    if not text and not cur.echo and c.finish_reason is None:
        return None
    num_tokens = cur.num_tokens
    logprobs = None
    if req.logprobs is not None and c.logprobs is not None:
        lp = _logprobs(
            engine.tokenizer, c.token_ids[num_tokens:], c.logprobs[num_tokens:], cur.offset
        )
        cur.offset += sum(len(t) for t in lp.tokens)
        logprobs = lp.model_dump(mode="json")
    choice: dict[str, Any] = {
        "index": prompt_index * req.n + c.index,
        "text": cur.echo + text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if req.return_token_ids:
        choice["token_ids"] = c.token_ids[num_tokens:]
    cur.echo = ""
    cur.num_chars = len(c.text)
    cur.num_tokens = len(c.token_ids)
    cur.done = c.finish_reason is not None
    return choice
