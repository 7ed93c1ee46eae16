"""Helpers shared by the completion and chat handlers: admission, streams, disconnects, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from kvserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from kvserve.engine.sleep_mode import EngineSleepingError
from kvserve.outputs import Logprob, PromptLogprobs, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sample.sampler import NO_TOKEN_ALLOWED
from kvserve.sampling_params import SamplingParams
from kvserve.server.batch_runner import BATCH_SCOPE_KEY
from kvserve.server.errors import APIError, bad_request
from kvserve.server.offload import SMALL_JOB_CHARS, run_cpu
from kvserve.server.protocol import (
    PromptLogprob,
    PromptLogprobsJSON,
    PromptTokensDetails,
    UsageInfo,
)

T = TypeVar("T")

# How often a non-streaming handler checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class Limits:
    """Server-wide request limits (the admission side of fairness: one request cannot ask
    for an unbounded share of the engine)."""

    max_tokens_limit: int | None = None  # most tokens one request may ask to generate
    max_n: int = 128  # most completions per prompt
    max_prompts_per_request: int = 256  # most prompts in one completions request
    # -- the cost of one request (issue 28; checked in request_limits.py) ---------------------
    # most sequences (prompts x n) one request starts: 256 x 128 would queue 32,768
    max_num_seqs_per_request: int = 256
    max_tools_per_request: int = 128  # OpenAI's own limit on tools
    max_json_schema_bytes: int = 64 * 1024  # a grammar's JSON schema, compact JSON
    max_json_schema_enum_members: int = 1024  # enum members across the schema (and choices)
    max_grammar_bytes: int = 64 * 1024  # regex, grammar, structural tag, choices together
    max_chat_messages: int = 1024
    max_chat_bytes: int = 1024 * 1024  # the conversation's text (UTF-8)
    # prompt tokens of one /score or /rerank request in all (a reranker repeats the query in
    # every document's prompt): 256 documents of 512 tokens
    max_score_tokens_per_request: int = 128 * 1024


def check_fan_out(limits: Limits, n: int, num_prompts: int) -> None:
    """400 for a request asking more sequences than the server lets one request start.

    Runs before any tokenization, so an oversized request costs the server nothing.
    """
    if n > limits.max_n:
        raise bad_request(f"n is {n}, above this server's limit of {limits.max_n} (--max-n)", "n")
    if num_prompts > limits.max_prompts_per_request:
        raise bad_request(
            f"the request has {num_prompts} prompts, above this server's limit of "
            f"{limits.max_prompts_per_request} (--max-prompts-per-request)",
            "prompt",
        )
    if n * num_prompts > limits.max_num_seqs_per_request:
        raise bad_request(
            f"the request asks for {num_prompts} prompts x n={n} = {n * num_prompts} sequences, "
            f"above this server's limit of {limits.max_num_seqs_per_request} "
            f"(--max-num-seqs-per-request)",
            "n",
        )


@dataclass
class PromptInfo:
    text: str | None  # the prompt text, when known (echo needs it)
    token_ids: list[int]


def usage_info(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """OpenAI's usage of finished requests (a prompt counts once, whatever its ``n``), with
    ``prompt_tokens_details.cached_tokens`` from the prefix cache."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# The JSON of every response body and SSE event: compact, UTF-8 kept as is.
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: BaseModel | dict[str, Any], drop_usage: bool = False) -> str:
    """One server-sent event. ``drop_usage`` omits the ``usage`` key entirely (no include_usage)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    if drop_usage:
        data.pop("usage", None)
    return f"data: {to_json(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkEncoder:
    """The SSE events of one streamed response, built without pydantic on the hot path.

    Every chunk of a stream shares ``id``, ``object``, ``created`` and ``model``: they are
    serialized once into a prefix, and each chunk only encodes its one choice (a plain dict
    whose keys are in the pydantic model's field order). The result is exactly what
    ``sse(CompletionResponse(...) / ChatCompletionChunk(...), drop_usage)`` gives for the same
    values: ``usage: null`` on every chunk with ``include_usage``, no ``usage`` key without it.
    """

    def __init__(self, request_id: str, obj: str, model: str, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        head = {"id": request_id, "object": obj, "created": self.created, "model": model}
        # '{"id":...,"model":"m"' + ',"choices":['
        self._head = f'data: {to_json(head)[:-1]},"choices":['
        self._tail = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def choice(self, choice: dict[str, Any], usage: tuple[int, int] | None = None) -> str:
        """The event carrying one choice; ``usage`` = (prompt, completion tokens so far) puts
        that usage on it instead of null (``continuous_usage_stats``, as ``UsageInfo``)."""
        if usage is None:
            return self._head + to_json(choice) + self._tail
        prompt, completion = usage
        data = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": None,
        }
        return f'{self._head}{to_json(choice)}],"usage":{to_json(data)}}}\n\n'


async def tokenize(engine: AsyncLLMEngine, text: str, add_special_tokens: bool = True) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer; send the prompt as token ids", "prompt")
    # Off the event loop whatever the size (a 1 MB text takes seconds), in the bounded pool.
    encode = functools.partial(tok.encode, text, add_special_tokens=add_special_tokens)
    return await run_cpu(encode, small=len(text) <= SMALL_JOB_CHARS)


def resolve_max_tokens(
    engine: AsyncLLMEngine,
    num_prompt: int,
    requested: int | None,
    limits: Limits,
    default: int | None = None,
) -> int | None:
    """Check prompt + max_tokens against the context (vLLM's message) and the server limit.

    ``requested=None`` means "the model's ``default`` (its generation_config.json
    max_new_tokens), else as much as the context allows" (chat's default), capped by the
    room left and the server's limit, as vLLM caps it; it returns the value for
    ``SamplingParams.max_tokens``.
    """
    max_len = engine.max_model_len
    if num_prompt >= max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"has {num_prompt} tokens, which leaves no room for a completion. Please reduce the "
            f"length of the prompt.",
            "messages" if requested is None else "prompt",
        )
    if requested is None:
        if limits.max_tokens_limit is None and default is None:
            return None  # the engine fills the room left in the context and the KV cache
        room = min(max_len, engine.kv_capacity_tokens) - num_prompt
        caps = [c for c in (limits.max_tokens_limit, default) if c is not None]
        return max(1, min(*caps, room))
    if limits.max_tokens_limit is not None and requested > limits.max_tokens_limit:
        raise bad_request(
            f"max_tokens is {requested}, above this server's limit of "
            f"{limits.max_tokens_limit} (--max-tokens-limit)",
            "max_tokens",
        )
    if num_prompt + requested > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} in the "
            f"completion). Please reduce the length of the prompt or completion.",
            "max_tokens",
        )
    return requested


def make_params(build: Any, *args: Any) -> SamplingParams:
    """Call a ``sampling_params`` builder, turning its ValueError into a 400."""
    try:
        return build(*args)
    except ValueError as e:  # a ParamError names the field
        raise bad_request(str(e), getattr(e, "param", None)) from e


async def check_grammar(
    raw: Request | None, engine: AsyncLLMEngine, params: SamplingParams
) -> None:
    """Compile the request's structured-output grammar now: an invalid one (or one past
    --grammar-compile-timeout / --grammar-compile-max-memory) is a 400 with the reason, and
    the engine never sees the request. An HTTP client that leaves (``raw``) cancels the
    compile, as does cancelling the caller's task."""
    if params.structured_outputs is None:
        return
    if raw is not None:
        await run_watching_disconnect(raw, engine.compile_grammar(params))
        return
    try:
        await engine.compile_grammar(params)
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from e


def is_batch_line(raw: Request | None) -> bool:
    """Whether ``raw`` is a Batch API line sent by the server's own batch runner: the
    engine runs it as background work (``Request.background``)."""
    return raw is not None and bool(raw.scope.get(BATCH_SCOPE_KEY))


def start_streams(
    engine: AsyncLLMEngine,
    prompts: Sequence[PromptInfo],
    params: SamplingParams | PoolingParams,
    base_id: str,
    priority: int = 0,
    background: bool = False,
) -> list[RequestStream]:
    """Submit one request per prompt (embedding requests with ``PoolingParams``); all or
    nothing (a failure aborts those already in). ``background``: batch lines."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            prompt = {"prompt": p.text, "prompt_token_ids": p.token_ids}
            if isinstance(params, PoolingParams):
                streams.append(engine.encode(prompt, params, rid, priority, background))
            else:
                streams.append(
                    engine.generate(prompt, params, rid, priority, background=background)
                )
    except BaseException as e:
        for s in streams:
            s.abort()
        raise engine_error(e) from e
    return streams


def engine_error(e: BaseException) -> BaseException:
    """Map the async engine's exceptions to API errors (others pass through)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(
            429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}
        )
    if isinstance(e, (EngineDeadError, EngineSleepingError)):
        return APIError(503, str(e))
    if isinstance(e, EngineStepError):
        return APIError(500, str(e))
    if isinstance(e, RequestFailedError):
        if NO_TOKEN_ALLOWED in str(e):  # the request's own constraints contradict each other
            return bad_request(str(e).removeprefix("sampling failed: "))
        return APIError(500, f"the engine failed on this request (no other was affected): {e}")
    if isinstance(e, ValueError):
        return bad_request(str(e), getattr(e, "param", None))  # a ParamError names its field
    return e


async def run_watching_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client goes away (non-streaming requests).

    Cancellation reaches the request streams' ``__anext__``, which abort their requests, so
    an abandoned request stops using the engine and its KV blocks are freed.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                try:
                    return task.result()
                except BaseException as e:
                    raise engine_error(e) from e
            if await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected")  # nobody will read this
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last output of each stream, run concurrently; aborts all on failure."""

    async def last(stream: RequestStream) -> RequestOutput:
        out: RequestOutput | None = None
        async for out in stream:  # noqa: B007 - outputs are cumulative: keep the last
            pass
        if out is None or not out.finished:
            raise EngineDeadError("the request was aborted")
        return out

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for s in streams:
            s.abort()


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from several streams as they come; closing aborts them all.

    Like each ``RequestStream``, the merge keeps only the newest (cumulative) output per
    stream that the consumer has not taken yet, so a slow consumer does not fall behind.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    latest: dict[int, RequestOutput] = {}  # stream index -> newest output not yet yielded
    errors: list[BaseException] = []
    ready = asyncio.Event()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                latest[i] = out
                ready.set()
        except Exception as e:
            errors.append(e)
        finally:
            ready.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            await ready.wait()
            ready.clear()
            while latest:  # a yield may let pumps add more
                i = next(iter(latest))
                yield i, latest.pop(i)
            if errors:
                raise errors[0]
            if all(t.done() for t in tasks) and not latest:
                return
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text for logprobs (vLLM's ``token_id:N`` form without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def logprob_text(tokenizer: Any, token_id: int, lp: Logprob) -> str:
    """``token_text``, taken from the engine's ``decoded_token`` when it filled one (the same
    decode of the token alone)."""
    return lp.decoded_token if lp.decoded_token is not None else token_text(tokenizer, token_id)


# vLLM's floor for a logprob in JSON, which has no -inf.
MIN_LOGPROB = -9999.0


def prompt_logprobs_json(lps: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """``RequestOutput.prompt_logprobs`` as vLLM's JSON (``clamp_prompt_logprobs``)."""
    if lps is None:
        return None
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(
                logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for t, lp in entry.items()
        }
        for entry in lps
    ]


def stream_error(e: BaseException) -> APIError:
    """The API error to put in an SSE stream for an exception raised mid-stream."""
    mapped = engine_error(e)
    if isinstance(mapped, APIError):
        return mapped
    return APIError(500, f"internal server error: {type(e).__name__}")
