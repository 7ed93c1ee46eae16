"""OpenTelemetry tracing: one ``llm_request`` span per request with vLLM's attributes,
parented to the caller's ``traceparent``; in process (the SDK's in-memory exporter) and
through a real OTLP/HTTP receiver fed by a ``kvserve serve --otlp-traces-endpoint`` process."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerState, build_app
from kvserve.server.tracing import RequestTracer, otlp_protocol, span_exporter
from tests.server.conftest import TINY, Server, free_port, start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LATENCIES = {
    "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
    "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
    "gen_ai.latency.time_in_model_inference",
}  # fmt: skip


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path) -> Iterator[tuple[TestClient, InMemorySpanExporter]]:
    """The app over the tiny model (with the built-in tokenizer), tracing to memory."""
    cfg = build_engine_config(str(tiny_model_dir), dtype="float32", num_kv_blocks=128)
    engine = AsyncLLMEngine(LLMEngine(cfg))
    exporter = InMemorySpanExporter()
    state = ServerState(tracer=RequestTracer(exporter=exporter))
    state.add_engine(engine)
    state.ready = True
    with TestClient(build_app(state)) as client:
        yield client, exporter
    state.shutdown()


def spans(client: TestClient, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    """The spans exported so far (the batch processor flushed), then forgotten."""
    tracer = client.app.state.kvserve.tracer  # type: ignore[attr-defined]
    assert tracer.force_flush()
    out = list(exporter.get_finished_spans())
    exporter.clear()
    return out


def check_latencies(attrs: dict[str, Any]) -> None:
    """vLLM's intervals, which add up: queue + prefill = TTFT, prefill + decode = inference."""
    lat = {k: attrs[k] for k in LATENCIES}
    assert all(v >= 0 for v in lat.values()), lat
    q, ttft = lat["gen_ai.latency.time_in_queue"], lat["gen_ai.latency.time_to_first_token"]
    prefill, decode = (lat["gen_ai.latency.time_in_model_prefill"],
                       lat["gen_ai.latency.time_in_model_decode"])  # fmt: skip
    inference, e2e = lat["gen_ai.latency.time_in_model_inference"], lat["gen_ai.latency.e2e"]
    assert q + prefill == pytest.approx(ttft, abs=1e-9)
    assert prefill + decode == pytest.approx(inference, abs=1e-9)
    assert q + inference <= e2e + 1e-9 and ttft <= e2e
    assert decode > 0  # several tokens: the decode phase took time


def test_span_has_vllms_attributes_and_joins_the_callers_trace(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    spans(client, exporter)
    body = {"prompt": "Once upon a time", "max_tokens": 5, "n": 2, "temperature": 0.7,
            "top_p": 0.9, "seed": 1, "ignore_eos": True}  # fmt: skip
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"}
    r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200
    usage = r.json()["usage"]
    (span,) = spans(client, exporter)
    assert span.name == "llm_request" and span.kind is SpanKind.SERVER
    assert span.context is not None and span.parent is not None
    assert f"{span.context.trace_id:032x}" == TRACE_ID  # the caller's trace
    assert f"{span.parent.span_id:016x}" == PARENT_ID and span.parent.is_remote
    assert dict(span.parent.trace_state) == {"vendor": "opaque"}
    attrs = dict(span.attributes or {})
    assert {k: v for k, v in attrs.items() if k not in LATENCIES} == {
        "gen_ai.response.model": TINY,
        "gen_ai.request.id": r.json()["id"],
        "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": 10,  # both choices
        "gen_ai.response.finish_reasons": ("length", "length"),
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.n": 2,
    }
    assert usage["completion_tokens"] == 10
    check_latencies(attrs)
    # The span covers the request: arrival to finish.
    assert span.start_time is not None and span.end_time is not None
    duration = (span.end_time - span.start_time) / 1e9
    assert duration == pytest.approx(attrs["gen_ai.latency.e2e"], abs=1e-6)


def test_one_root_span_per_prompt_and_per_stream(
    traced: tuple[TestClient, InMemorySpanExporter],
) -> None:
    client, exporter = traced
    spans(client, exporter)
    body = {"prompt": ["Hello", "A much longer prompt than that"], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = client.post("/v1/completions", json=body)  # no traceparent: new traces
    assert r.status_code == 200
    got = sorted(
        spans(client, exporter), key=lambda s: str((s.attributes or {})["gen_ai.request.id"])
    )
    rid = r.json()["id"]
    assert [(s.attributes or {})["gen_ai.request.id"] for s in got] == [f"{rid}-0", f"{rid}-1"]
    assert all(s.parent is None for s in got)
    assert len({s.context.trace_id for s in got if s.context}) == 2
    prompt_tokens = [(s.attributes or {})["gen_ai.usage.prompt_tokens"] for s in got]
    assert sum(prompt_tokens) == r.json()["usage"]["prompt_tokens"] and prompt_tokens[0] < 3
    assert [(s.attributes or {})["gen_ai.request.temperature"] for s in got] == [0.0, 0.0]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with client.stream(
        "POST", "/v1/chat/completions", json=chat, headers={"traceparent": TRACEPARENT}
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    (span,) = spans(client, exporter)
    attrs = dict(span.attributes or {})
    assert str(attrs["gen_ai.request.id"]).startswith("chatcmpl-")
    assert attrs["gen_ai.usage.completion_tokens"] == 4
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    check_latencies(attrs)


def test_protocol_and_endpoint_come_from_the_standard_environment() -> None:
    assert otlp_protocol({}) == "grpc"  # vLLM's default
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}  # fmt: skip
    assert otlp_protocol(both) == "grpc"  # the traces-specific one wins
    with pytest.raises(ValueError, match="http/json"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    http = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    exporter = span_exporter("http://127.0.0.1:4318", http)
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"  # the standard path added
    assert span_exporter("http://c:4318/custom", http)._endpoint == "http://c:4318/custom"
    assert isinstance(span_exporter("http://127.0.0.1:4317", {}), GrpcExporter)


def test_tracing_is_a_server_option_that_loads_nothing_when_off() -> None:
    with pytest.raises(ValueError, match="option of `kvserve serve`"):
        EngineArgs.from_kwargs(otlp_traces_endpoint="http://127.0.0.1:4317")
    # A request through an app without a tracer loads neither the SDK nor an exporter
    # (FastAPI itself imports the OpenTelemetry API, not kvserve).
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from kvserve.server.app import ServerState, build_app\n"
        "from kvserve.server.cli import main\n"
        "c = TestClient(build_app(ServerState()))\n"
        "assert c.post('/v1/completions', json={'prompt': 'x'}).status_code == 503\n"
        "assert c.get('/metrics').status_code == 200\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'opentelemetry.proto'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_flag_without_the_sdk_is_a_clear_error() -> None:
    # The SDK hidden from imports (the API stays: FastAPI needs it): exit 2 before loading.
    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')):\n"
        "            raise ImportError(f'no module named {name}')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from kvserve.server.cli import main\n"
        "sys.exit(main(['--otlp-traces-endpoint', 'http://127.0.0.1:4317']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pip install 'kvserve[tracing]'" in r.stderr


class _Collector:
    """A minimal OTLP/HTTP trace receiver: POST /v1/traces with ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    collector.requests.append(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict[str, Any], ProtoSpan]]:
        """(resource attributes, span) of every span received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                out += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
        return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind)


@pytest.mark.slow
def test_real_server_exports_over_otlp_http(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = _Collector()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    # A long batch delay: spans wait in the BatchSpanProcessor until the server exits, so
    # this also shows that a SIGTERM flushes them.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    srv: Server = start_server(
        [str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "128",
         "--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}/v1/traces"],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        body = {"model": TINY, "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": 6, "temperature": 0.5, "top_p": 0.8, "ignore_eos": True}  # fmt: skip
        r = httpx.post(
            f"{srv.url}/v1/chat/completions", json=body,
            headers={"traceparent": TRACEPARENT}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200
        time.sleep(0.5)
        assert collector.spans() == []  # batched, not sent per request
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    (resource, span), *more = collector.spans()
    assert more == []
    assert resource["service.name"] == "kvserve"
    assert span.name == "llm_request" and span.kind == ProtoSpan.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: _value(a.value) for a in span.attributes}
    usage = r.json()["usage"]
    assert {k: v for k, v in attrs.items() if k not in LATENCIES} == {
        "gen_ai.response.model": TINY,
        "gen_ai.request.id": r.json()["id"],
        "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": 6,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.8,
        "gen_ai.request.max_tokens": 6,
        "gen_ai.request.n": 1,
    }
    check_latencies(attrs)
    e2e_ns = span.end_time_unix_nano - span.start_time_unix_nano
    assert e2e_ns / 1e9 == pytest.approx(attrs["gen_ai.latency.e2e"], abs=1e-6)
