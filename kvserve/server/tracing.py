"""OpenTelemetry tracing (``kvserve serve --otlp-traces-endpoint URL``, vLLM's flag).

One span per engine request, named ``llm_request`` (kind SERVER) with vLLM's ``gen_ai.*``
attributes (``vllm/tracing.py``'s ``SpanAttributes``): the model, request id, token usage,
sampling parameters and the latency breakdown. It starts at the request's arrival and ends
when it finished, and it joins the caller's trace when the HTTP request carries a W3C
``traceparent`` (and ``tracestate``) header. Spans go through the SDK's
``BatchSpanProcessor`` to an OTLP exporter, gRPC or http/protobuf as the standard
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` say (default grpc,
as vLLM); the other ``OTEL_*`` variables (headers, timeouts, ``OTEL_BSP_*`` batching,
``OTEL_SERVICE_NAME``) apply as usual.

Off by default. Then nothing imports OpenTelemetry and a request costs nothing: the server
holds no tracer and streams carry no hook. On, the span is built in the event loop when the
finished output reaches the request's stream (not in the engine thread, whose time is the
throughput), and it is exported on the SDK's own thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.async_engine import RequestStream

logger = logging.getLogger("kvserve.server")

SPAN_NAME = "llm_request"  # vLLM's
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = (
    "--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
    "pip install 'kvserve[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp)"
)


class SpanAttributes:
    """vLLM's span attribute names (``vllm/tracing.py``), from the OpenTelemetry GenAI
    semantic conventions where they exist."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # semconv, not vLLM
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context headers of a request (lower-case names)."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def otlp_protocol(env: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol the standard environment variables choose (the traces-specific one
    first); raises ValueError for one the Python exporters do not speak."""
    env = os.environ if env is None else env
    protocol = next((env[k] for k in PROTOCOL_ENV if env.get(k)), "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"unsupported OTLP protocol {protocol!r} ({' / '.join(PROTOCOL_ENV)}); "
            f"use one of {list(PROTOCOLS)}"
        )
    return protocol


def span_exporter(endpoint: str, env: Mapping[str, str] | None = None) -> Any:
    """An OTLP span exporter to ``endpoint`` over the protocol the environment chooses.

    http/protobuf posts to the URL as given (the OTLP rule for a traces endpoint), except
    that a bare ``http://host:4318`` gets the standard ``/v1/traces`` path."""
    protocol = otlp_protocol(env)
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from e
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Makes the ``llm_request`` spans of one server (its own ``TracerProvider``: nothing
    global, so several servers or tests in one process do not mix their spans)."""

    def __init__(self, endpoint: str | None = None, exporter: Any = None) -> None:
        """Export to ``endpoint`` (see ``span_exporter``), or to ``exporter`` (tests: the
        SDK's ``InMemorySpanExporter``). Raises ValueError when OpenTelemetry is missing."""
        try:
            from opentelemetry.propagators.textmap import DefaultGetter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise ValueError(f"{INSTALL_HINT} ({e})") from e
        if exporter is None:
            if not endpoint:
                raise ValueError("give an OTLP endpoint or an exporter")
            exporter = span_exporter(endpoint)
        # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES still win; "kvserve" is the default.
        service = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "kvserve"}
        self.provider = TracerProvider(resource=Resource.create(service))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("kvserve.server")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        self._kind = SpanKind.SERVER
        self.endpoint = endpoint

    def watch(
        self,
        streams: Sequence[RequestStream],
        model: str,
        params: SamplingParams,
        headers: Mapping[str, str],
    ) -> None:
        """Trace each of one API request's engine requests (one per prompt) when it
        finishes, as a child of the caller's ``traceparent`` when ``headers`` carry one."""
        context = self._propagator.extract(trace_headers(headers), getter=self._getter)
        for stream in streams:
            stream.on_finished = self._finisher(context, model, params)

    def _finisher(
        self, context: Any, model: str, params: SamplingParams
    ) -> Callable[[RequestOutput], None]:
        return lambda out: self.record(out, model, params, context)

    def record(
        self, out: RequestOutput, model: str, params: SamplingParams, context: Any = None
    ) -> None:
        """Emit the span of a finished request (monotonic engine times -> epoch ns)."""
        m = out.metrics
        if m is None:
            return
        to_ns = time.time_ns() - time.monotonic_ns()
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        span = self._tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=self._kind,
            attributes=span_attributes(out, model, params),
            start_time=int(m.arrival_time * 1e9) + to_ns,
        )
        span.end(end_time=int(end * 1e9) + to_ns)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self.provider.force_flush(timeout_millis))

    def shutdown(self) -> None:
        """Export what is still queued and stop the exporter thread (server exit)."""
        self.provider.shutdown()


def span_attributes(out: RequestOutput, model: str, params: SamplingParams) -> dict[str, Any]:
    """vLLM's ``llm_request`` attributes of a finished request. The latencies are vLLM's
    intervals: queue = arrival..first scheduled, prefill = first scheduled..first token,
    decode = first..last token, inference = first scheduled..last token, e2e =
    arrival..finish. Unlike vLLM, sampling parameters are set even when 0 (greedy is a
    temperature worth seeing)."""
    a = SpanAttributes
    attrs: dict[str, Any] = {
        a.GEN_AI_RESPONSE_MODEL: model,
        a.GEN_AI_REQUEST_ID: out.request_id,
        a.GEN_AI_USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
        a.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(c.token_ids) for c in out.outputs),
        a.GEN_AI_RESPONSE_FINISH_REASONS: [str(c.finish_reason) for c in out.outputs],
        a.GEN_AI_REQUEST_TEMPERATURE: float(params.temperature),
        a.GEN_AI_REQUEST_TOP_P: float(params.top_p),
        a.GEN_AI_REQUEST_N: params.n,
    }
    if params.max_tokens is not None:
        attrs[a.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
    m = out.metrics
    if m is None:
        return attrs
    if m.finished_time is not None:
        attrs[a.GEN_AI_LATENCY_E2E] = m.finished_time - m.arrival_time
    sched, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
    if sched is not None:
        attrs[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = sched - m.arrival_time
    if first is not None:
        attrs[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - m.arrival_time
    if sched is not None and first is not None:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - sched
    if first is not None and last is not None:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
    if sched is not None and last is not None:
        attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - sched
    return attrs
