"""``kvserve.v1.Generation``: the gRPC twin of ``POST /v1/completions`` for one prompt.

A call is turned into the HTTP API's own ``CompletionRequest`` (so pydantic checks the same
ranges and types) and goes through ``prepare_completion`` and ``start_streams``, exactly as a
completions request does: same engines, same API key, same queue caps, same messages. HTTP
errors become gRPC statuses (``STATUS_CODES``); a full queue's ``Retry-After`` travels as the
``retry-after`` trailing metadata. A cancelled call (client gone, deadline passed) cancels the
handler's task, whose request stream then aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from pydantic import ValidationError

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kvserve.server.app import SHUTTING_DOWN, ServerState, bearer_matches
from kvserve.server.completions import prepare_completion
from kvserve.server.errors import APIError, bad_request, validation_message
from kvserve.server.grpc import kvserve_pb2 as pb
from kvserve.server.grpc import kvserve_pb2_grpc as pb_grpc
from kvserve.server.protocol import CompletionRequest
from kvserve.server.serving import (
    MIN_LOGPROB,
    final_outputs,
    logprob_text,
    new_id,
    start_streams,
    stream_error,
    usage_info,
)

# The gRPC status of each HTTP status the API answers (the usual HTTP <-> gRPC mapping).
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,  # an unknown model (HTTP: model_not_found)
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,  # the queue caps
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,  # loading, draining, dead engine
}
UNAUTHENTICATED = "Incorrect or missing API key: send the metadata 'authorization: Bearer <key>'"


def completion_request(request: pb.GenerateRequest) -> CompletionRequest:
    """The HTTP API's request for this call; ``APIError`` 400 with pydantic's message.

    Only the fields the client set are passed (``ListFields``: optional fields with presence,
    other scalars when not zero, repeated fields when not empty), so every unset field takes
    the HTTP default. The proto's field names are ``CompletionRequest``'s.
    """
    body: dict[str, Any] = {
        f.name: list(value) if f.is_repeated else value for f, value in request.params.ListFields()
    }
    body["model"] = request.model or None
    kind = request.WhichOneof("prompt")
    if kind == "text":
        body["prompt"] = request.text
    elif kind == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise bad_request(message, param) from e


def _logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], k: int
) -> list[pb.TokenLogprob]:
    """Per token: the sampled token's logprob and the ``k`` most likely, most likely first."""
    out = []
    for tid, top in zip(token_ids, logprobs, strict=False):
        own = top.get(tid)
        entry = pb.TokenLogprob(token_id=tid)
        if own is not None:
            entry.token = logprob_text(tokenizer, tid, own)
            entry.logprob = max(own.logprob, MIN_LOGPROB)
            entry.rank = own.rank or 0
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:k]
        entry.top_logprobs.extend(
            pb.TopLogprob(
                token_id=t,
                token=logprob_text(tokenizer, t, lp),
                logprob=max(lp.logprob, MIN_LOGPROB),
                rank=lp.rank or 0,
            )
            for t, lp in ranked
        )
        out.append(entry)
    return out


def _choice(
    tokenizer: Any, c: CompletionOutput, logprobs: int | None, tokens: int = 0, chars: int = 0
) -> pb.Choice:
    """Choice ``c`` from its ``tokens``-th token and ``chars``-th character on."""
    choice = pb.Choice(
        index=c.index,
        text=c.text[chars:],
        token_ids=c.token_ids[tokens:],
        finish_reason=c.finish_reason or "",
    )
    if isinstance(c.stop_reason, str):
        choice.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        choice.stop_token_id = c.stop_reason
    if logprobs is not None and c.logprobs is not None:
        lps = _logprobs(tokenizer, c.token_ids[tokens:], c.logprobs[tokens:], logprobs)
        choice.logprobs.extend(lps)
    return choice


def _usage(out: RequestOutput) -> pb.Usage:
    usage = usage_info([out])
    details = usage.prompt_tokens_details
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=details.cached_tokens if details is not None else 0,
    )


@dataclass
class _Cursor:
    """What has been sent of one streamed choice."""

    tokens: int = 0
    chars: int = 0
    done: bool = False


def stream_message(
    request_id: str,
    tokenizer: Any,
    logprobs: int | None,
    cursors: dict[int, _Cursor],
    out: RequestOutput,
) -> pb.GenerateStreamResponse | None:
    """What ``out`` adds to the stream, or None when nothing is new. Unlike the SSE stream,
    tokens whose text is not known yet (a partial UTF-8 character, a held-back stop-string
    prefix) are sent at once: token ids are first-class here."""
    msg = pb.GenerateStreamResponse(request_id=request_id)
    for c in out.outputs:
        cur = cursors.setdefault(c.index, _Cursor())
        new = len(c.token_ids) > cur.tokens or len(c.text) > cur.chars
        if cur.done or not (new or c.finish_reason is not None):
            continue
        msg.choices.append(_choice(tokenizer, c, logprobs, cur.tokens, cur.chars))
        cur.tokens, cur.chars = len(c.token_ids), len(c.text)
        cur.done = c.finish_reason is not None
    if out.finished:
        msg.usage.CopyFrom(_usage(out))
    return msg if msg.choices or out.finished else None


async def abort_with(context: grpc.aio.ServicerContext, error: APIError) -> NoReturn:
    """End the call with the gRPC status of ``error`` (raises, as ``context.abort`` does)."""
    trailing: tuple[tuple[str, str], ...] = ()
    if error.headers and "Retry-After" in error.headers:
        trailing = (("retry-after", error.headers["Retry-After"]),)
    code = STATUS_CODES.get(error.status, grpc.StatusCode.UNKNOWN)
    await context.abort(code, error.message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


class GenerationService(pb_grpc.GenerationServicer):
    """The servicer; ``state`` is the HTTP app's, shared as it is."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        # The shutdown drain waits for calls in flight as for HTTP requests.
        self.state.grpc_in_flight += 1
        try:
            yield
        finally:
            self.state.grpc_in_flight -= 1

    def _check_access(self, context: grpc.aio.ServicerContext) -> None:
        """The HTTP guard's checks, in its order: the API key, then the drain."""
        key = self.state.api_key
        if key:
            values = [
                v.encode("utf-8", "replace") if isinstance(v, str) else v
                for k, v in context.invocation_metadata() or ()
                if k == "authorization"
            ]
            # two copies are refused, as over HTTP: which one counts would depend on the reader
            if not (len(values) == 1 and bearer_matches(values[0], key)):
                raise APIError(401, UNAUTHENTICATED, code="invalid_api_key")
        if self.state.draining:
            raise APIError(503, SHUTTING_DOWN)

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[AsyncLLMEngine, CompletionRequest, RequestStream, str]:
        """Validate and queue the request, as ``create_completion`` does; raises APIError."""
        self._check_access(context)
        req = completion_request(request)
        engine = self.state.engine_for(req.model)
        prompts, params = await prepare_completion(req, engine, self.state.limits)
        request_id = new_id("grpc")
        (stream,) = start_streams(engine, prompts, params, request_id, req.priority)
        return engine, req, stream, request_id

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        with self._counted():
            try:
                engine, req, stream, request_id = await self._start(request, context)
                # Cancelled with the call: final_outputs then aborts the request.
                (out,) = await final_outputs([stream])
            except Exception as e:
                error = stream_error(e)
            else:
                tok = engine.tokenizer
                return pb.GenerateResponse(
                    request_id=request_id,
                    model=engine.model_name,
                    choices=[_choice(tok, c, req.logprobs) for c in out.outputs],
                    usage=_usage(out),
                    prompt_token_ids=out.prompt_token_ids,
                )
            await abort_with(context, error)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        with self._counted():
            try:
                engine, req, stream, request_id = await self._start(request, context)
            except Exception as e:
                await abort_with(context, stream_error(e))
            cursors: dict[int, _Cursor] = {}
            error = None
            try:
                # A cancelled call cancels this generator's task: the stream's __anext__ then
                # aborts the request, and the finally below makes sure of it.
                async for out in stream:
                    msg = stream_message(request_id, engine.tokenizer, req.logprobs, cursors, out)
                    if msg is not None:
                        yield msg
            except Exception as e:
                error = stream_error(e)
            finally:
                stream.abort()
            if error is not None:
                await abort_with(context, error)
