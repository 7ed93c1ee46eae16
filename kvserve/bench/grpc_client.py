"""The ``grpc`` backend of ``bench serve``: kvserve's ``GenerateStream`` (``kvserve serve
--grpc-port``), timed like the HTTP backends (``kvserve.bench.client``).

* TTFT: from just before the call to the first message carrying generated tokens;
* ITL: the gaps between such messages (a message holding several tokens is one gap, as a
  coalesced SSE chunk is);
* E2E latency: from the call to the last token-carrying message.

Token counts come from the ``usage`` of the stream's last message. The request carries what an
HTTP request body would: ``max_tokens``, ``ignore_eos`` and the sampling options
(``--temperature``, ``--top-k``... and ``--extra-body``), mapped onto ``SamplingParameters``
by name; a field the gRPC API lacks is an error, not silently dropped. The ``Authorization``
header (``--api-key``) and ``--header`` values travel as call metadata.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc

from kvserve.bench.client import RequestInput, RequestRecord, TokenCounter
from kvserve.server.grpc import kvserve_pb2 as pb
from kvserve.server.grpc import kvserve_pb2_grpc as pb_grpc

_PARAM_FIELDS = {f.name: f for f in pb.SamplingParameters.DESCRIPTOR.fields}
# HTTP-only headers that are not call metadata (gRPC sets its own content type).
_NOT_METADATA = {"content-type"}


@dataclass
class GrpcConnection:
    """One channel to the server (calls are multiplexed over its HTTP/2 connection)."""

    stub: pb_grpc.GenerationStub
    timeout_s: float | None = None


@contextlib.asynccontextmanager
async def open_connection(
    target: str, timeout_s: float | None = None
) -> AsyncIterator[GrpcConnection]:
    """A channel to ``target`` (``host:port``) for the duration of a benchmark."""
    # No client-side cap on message size: the server enforces its own.
    options = [("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        yield GrpcConnection(pb_grpc.GenerationStub(channel), timeout_s)


def sampling_parameters(inp: RequestInput) -> pb.SamplingParameters:
    """``SamplingParameters`` from what the HTTP body would carry; ValueError for a field
    the gRPC API does not have."""
    params = pb.SamplingParameters(max_tokens=inp.max_tokens, ignore_eos=inp.ignore_eos)
    for name, value in (inp.extra_body or {}).items():
        field = _PARAM_FIELDS.get(name)
        if field is None:
            raise ValueError(
                f"{name!r} has no gRPC equivalent (SamplingParameters has "
                f"{', '.join(sorted(_PARAM_FIELDS))})"
            )
        if field.is_repeated:
            getattr(params, name).extend(value if isinstance(value, list) else [value])
        else:
            setattr(params, name, value)
    return params


def call_metadata(headers: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """HTTP headers as gRPC metadata (keys lower-case, as gRPC requires)."""
    items = (headers or {}).items()
    return tuple((k.lower(), v) for k, v in items if k.lower() not in _NOT_METADATA)


class _Timing:
    """Timings and counts while a stream is read."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.token_messages = 0
        self.last_token_time = record.start_time
        self.parts: list[str] = []
        self.usage: pb.Usage | None = None

    def on_message(self, msg: pb.GenerateStreamResponse, now: float) -> None:
        tokens = sum(len(c.token_ids) for c in msg.choices)
        for c in msg.choices:
            self.parts.append(c.text)
            if c.finish_reason:
                self.record.finish_reason = c.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage
        if tokens == 0:
            return
        if self.token_messages == 0:
            self.record.ttft = now - self.record.start_time
        else:
            self.record.itl.append(now - self.last_token_time)
        self.token_messages += 1
        self.last_token_time = now

    def finish(self, count_tokens: TokenCounter | None) -> None:
        rec = self.record
        rec.generated_text = "".join(self.parts)
        rec.latency = self.last_token_time - rec.start_time
        if self.token_messages == 0:
            rec.error = "the stream ended without any generated token."
            return
        if self.usage is None:
            rec.error = "the stream ended without usage (cut off)."
            return
        rec.success = True
        rec.prompt_len = self.usage.prompt_tokens
        rec.cached_tokens = self.usage.cached_tokens
        rec.output_tokens, rec.output_tokens_source = self.usage.completion_tokens, "usage"


async def request_grpc(
    conn: GrpcConnection, inp: RequestInput, count_tokens: TokenCounter | None = None
) -> RequestRecord:
    """Send one ``GenerateStream`` call and time it (``count_tokens`` is unused: the stream
    always ends with the server's usage)."""
    record = RequestRecord(prompt_len=inp.prompt_len, expected_output_len=inp.expected_output_len)
    timing = _Timing(record)
    try:
        request = pb.GenerateRequest(
            model=inp.model, text=inp.prompt, params=sampling_parameters(inp)
        )
        metadata = call_metadata(inp.headers)
        record.start_time = time.perf_counter()
        timing.last_token_time = record.start_time
        call = conn.stub.GenerateStream(request, metadata=metadata, timeout=conn.timeout_s)
        async for msg in call:
            timing.on_message(msg, time.perf_counter())
        timing.finish(count_tokens)
    except grpc.aio.AioRpcError as e:
        _fail(record, timing, f"gRPC {e.code().name}: {e.details()}")
    except Exception as e:  # the record carries the failure; one bad request must not stop a run
        _fail(record, timing, f"{type(e).__name__}: {e}")
    return record


def _fail(record: RequestRecord, timing: _Timing, error: str) -> None:
    record.success = False
    record.error = error
    record.generated_text = "".join(timing.parts)
    record.latency = time.perf_counter() - record.start_time if record.start_time else 0.0


def grpc_target(base_url: str, port: int) -> str:
    """``host:port`` of the gRPC API: the HTTP base URL's host with ``port``."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
