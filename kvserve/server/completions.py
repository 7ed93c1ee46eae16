"""``POST /v1/completions``: several prompts, n completions each, legacy logprobs, echo, SSE."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kvserve.sampling_params import SamplingParams
from kvserve.server.beam import create_beam_completion
from kvserve.server.errors import bad_request, error_event
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.request_limits import check_request_cost
from kvserve.server.serving import (
    MIN_LOGPROB,
    SSE_DONE,
    ChunkEncoder,
    Limits,
    PromptInfo,
    check_fan_out,
    check_grammar,
    final_outputs,
    is_batch_line,
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
    tokenize,
    usage_info,
)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise bad_request("best_of must be unset or equal to n", "best_of")
    if req.max_tokens == 0 and not req.echo:
        # Only echo makes a 0-token completion useful (scoring the prompt), as in vLLM.
        raise bad_request("max_tokens must be at least 1, got 0.", "max_tokens")


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``max_tokens: 0`` with echo: the engine computes one token (``SamplingParams`` needs
    at least one; its prompt logprobs come from the same pass) and it is not returned: no
    text, no token, no logprob, 0 completion tokens, finish reason ``length`` (OpenAI's)."""
    outputs = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
            logprobs=None if c.logprobs is None else [],
            finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
            stop_reason=None,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=outputs)


def prompt_items(prompt: Any, field: str = "prompt") -> list[Any]:
    """The four prompt forms (a string, token ids, a list of either) as a list of prompts,
    each a string or a list of token ids; ``field`` names the request field in errors
    (``input`` for embeddings)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # one prompt of token ids
    else:
        items = list(prompt)
    if not items:
        raise bad_request(f"{field} must not be empty", field)
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
    tokenizer: Any,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    offset: int,
) -> CompletionLogProbs:
    """OpenAI's legacy format; ``offset`` is the text offset of the first token. A None
    entry (the first prompt token, with echo) has null logprobs, as in vLLM."""
    lp = CompletionLogProbs()
    for tid, top in zip(token_ids, logprobs, strict=False):
        own = None if top is None else top.get(tid)
        text = token_text(tokenizer, tid) if own is None else logprob_text(tokenizer, tid, own)
        lp.tokens.append(text)
        lp.token_logprobs.append(None if own is None else max(own.logprob, MIN_LOGPROB))
        lp.text_offset.append(offset)
        offset += len(text)
        if top is None:
            lp.top_logprobs.append(None)
            continue
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)
        lp.top_logprobs.append(
            {logprob_text(tokenizer, t, v): max(v.logprob, MIN_LOGPROB) for t, v in ranked}
        )
    return lp


def _prompt_text(engine: AsyncLLMEngine, p: PromptInfo) -> str:
    if p.text is not None:
        return p.text
    return engine.tokenizer.decode(p.token_ids) if engine.tokenizer is not None else ""


async def prepare_completion(
    req: CompletionRequest, engine: AsyncLLMEngine, limits: Limits, raw: Request | None = None
) -> tuple[list[PromptInfo], SamplingParams]:
    """Every check of a completion request and its engine inputs: the tokenized prompts and
    their ``SamplingParams``; raises ``APIError`` (400). Shared with the gRPC API, so both
    validate alike (``raw``: the HTTP request, whose disconnect cancels the grammar compile;
    a cancelled gRPC call cancels it through its task)."""
    _check_unsupported(req)
    items = prompt_items(req.prompt)
    check_fan_out(limits, req.n, len(items))
    prompts = await _prompts(engine, items)
    # One SamplingParams for all prompts: the smallest resolved max_tokens fits every prompt.
    requested = 1 if req.max_tokens == 0 else req.max_tokens  # 0: see _prompt_only
    defaults = engine.default_sampling_params  # the model's (--generation-config auto)
    default = defaults.get("max_tokens")
    if requested is not None and "max_tokens" not in req.model_fields_set:
        # not sent: the smaller of the field's 16 and the model's max_new_tokens (vLLM's
        # rule), and never above --max-tokens-limit (a request that asks nothing is no 400)
        caps = [c for c in (default, limits.max_tokens_limit) if c is not None]
        requested = min([requested, *caps])
    resolved = [
        resolve_max_tokens(engine, len(p.token_ids), requested, limits, default) for p in prompts
    ]
    max_tokens = None if resolved[0] is None else min(r for r in resolved if r is not None)
    params = make_params(req.sampling_params, max_tokens, req.logprobs, defaults)
    check_request_cost(limits, engine, params, req, "logprobs")
    await check_grammar(raw, engine, params)
    return prompts, params


async def create_completion(
    req: CompletionRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    if req.use_beam_search:
        return await create_beam_completion(req, raw, engine, limits)
    prompts, params = await prepare_completion(req, engine, limits, raw)
    request_id = new_id("cmpl")
    streams = start_streams(engine, prompts, params, request_id, req.priority, is_batch_line(raw))
    raw.app.state.kvserve.observe_streams(engine, params, streams, raw.headers)
    if req.stream:
        return StreamingResponse(
            _stream(req, engine, prompts, streams, request_id), media_type="text/event-stream"
        )
    outputs = await run_watching_disconnect(raw, final_outputs(streams))
    if req.max_tokens == 0:
        outputs = [_prompt_only(o) for o in outputs]
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
        if req.echo and out.prompt_logprobs is not None:
            # vLLM: logprobs over prompt + completion, text offsets from 0 (lm-eval's scoring)
            ids = [*out.prompt_token_ids, *c.token_ids]
            logprobs = _logprobs(engine.tokenizer, ids, [*out.prompt_logprobs, *c.logprobs], 0)
        else:
            logprobs = _logprobs(engine.tokenizer, c.token_ids, c.logprobs, len(echo))
    return CompletionChoice(
        index=index,
        text=echo + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=list(c.token_ids) if req.return_token_ids else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )


class _ChoiceCursor:
    """What has been sent of one streamed choice."""

    def __init__(self, echo: str, echoing: bool = False) -> None:
        self.echo = echo  # prompt text still to send (echo), sent with the first chunk
        self.prompt_pending = echoing  # echo: the prompt's logprobs go with the first chunk
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
        i * req.n + k: _ChoiceCursor(_prompt_text(engine, p) if req.echo else "", req.echo)
        for i, p in enumerate(prompts)
        for k in range(req.n)
    }
    enc = ChunkEncoder(request_id, "text_completion", engine.model_name, req.include_usage)
    finished: list[RequestOutput] = []
    merged = merge_streams(streams)
    try:
        async for i, out in merged:
            if req.max_tokens == 0:
                out = _prompt_only(out)  # the same output, its generation dropped
            for c in out.outputs:
                cur = cursors[i * req.n + c.index]
                choice = _delta_choice(req, engine, cur, i, c, out)
                if choice is not None:
                    # continuous_usage_stats: this prompt's tokens and this choice's so far (vLLM)
                    usage = (len(out.prompt_token_ids), cur.num_tokens)
                    yield enc.choice(choice, usage if req.continuous_usage else None)
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
    out: RequestOutput,
) -> dict[str, Any] | None:
    """What is new in ``c`` since the last chunk, as a ``CompletionChoice``'s JSON fields (in
    its field order, ``None`` token ids left out), or None if nothing is new. With echo and
    logprobs the first chunk carries the prompt's logprobs too, as vLLM's does."""
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
        ids: list[int] = c.token_ids[num_tokens:]
        lps: list[TokenLogprobs | None] = list(c.logprobs[num_tokens:])
        if cur.prompt_pending and out.prompt_logprobs is not None:
            ids, lps = [*out.prompt_token_ids, *ids], [*out.prompt_logprobs, *lps]
            cur.offset = 0  # offsets count from the prompt's first token, as non-streamed
        lp = _logprobs(engine.tokenizer, ids, lps, cur.offset)
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
    cur.prompt_pending = False
    cur.num_chars = len(c.text)
    cur.num_tokens = len(c.token_ids)
    cur.done = c.finish_reason is not None
    return choice
