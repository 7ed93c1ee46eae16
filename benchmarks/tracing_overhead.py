"""What does OpenTelemetry tracing cost? Throughput at concurrency 64, tracing on vs off.

Two ``kvserve serve`` processes serve the same model with the same settings; one has
``--otlp-traces-endpoint`` pointing at an OTLP/HTTP receiver run by this script (it only
stores the request bodies while measuring and decodes them afterwards, so that it takes no
CPU from the server during a run), the other has tracing off. Both start at once and stay
up; each repeat measures both with ``kvserve bench serve`` on the same requests (random
prompts, fixed output lengths with ``ignore_eos``, 64 requests in flight, every request
carrying a W3C ``traceparent`` as a traced caller's would), the order reversed every other
repeat so slow spells of a shared machine fall on both. A warm-up run on each server comes
first.

The ratio is median output tokens/s with tracing over median without; the target (issue 18)
is at least 0.98 (tracing costs at most 2%). The receiver's span count is checked against
the requests sent to the traced server (one ``llm_request`` span each, none lost). Prints a
markdown table and writes ``--out`` (every run, medians, ratio, spans, settings, machine).

    python benchmarks/tracing_overhead.py                       # the measurement
    python benchmarks/tracing_overhead.py --num-prompts 64 --repeats 1 --output-len 32 \\
        --out /tmp/tracing.json                                 # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gzip
import os
import statistics
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `benchmarks` importable

from benchmarks.machine import machine_info  # noqa: E402
from kvserve.bench import serve  # noqa: E402
from kvserve.bench.sweep import ServerProcess, free_port  # noqa: E402

SERVED_NAME = "m"
MODES = ("off", "on")
TARGET_RATIO = 0.98
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Receiver:
    """An OTLP/HTTP trace receiver that stores the bodies of POST /v1/traces (decoded later:
    parsing protobuf while the server is measured would take CPU from it)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def num_spans(self) -> int:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        total = 0
        for body in self.bodies:
            req = ExportTraceServiceRequest.FromString(body)
            total += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return total


def server_cmd(args: argparse.Namespace, port: int, endpoint: str | None) -> list[str]:
    cmd = [
        "env", f"OMP_NUM_THREADS={args.threads}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
        sys.executable, "-m", "kvserve.cli", "serve", args.model,
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--num-threads", str(args.threads),
        "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", args.kv_cache_memory,
        "--no-access-log",
    ]  # fmt: skip
    return cmd + (["--otlp-traces-endpoint", endpoint] if endpoint else [])


def bench_args(args: argparse.Namespace, seed: int, num_prompts: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    argv = [
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
        "--tokenizer", args.model, "--served-model-name", SERVED_NAME, "--seed", str(seed),
        "--header", f"traceparent={TRACEPARENT}", "--disable-tqdm", "--metrics-interval", "2",
    ]  # fmt: skip
    return parser.parse_args(argv)


def run_bench(bench: argparse.Namespace, samples: Any, tokenizer: Any, url: str) -> dict[str, Any]:
    """One ``bench serve`` run of prepared samples against the server at ``url``."""
    run = argparse.Namespace(**vars(bench))
    run.base_url = url
    return asyncio.run(serve.benchmark(run, samples, tokenizer))


def measure(args: argparse.Namespace, urls: dict[str, str]) -> list[dict[str, Any]]:
    """Warm-up, then every repeat on both servers (order alternating); the run records."""
    warm = bench_args(args, 10_000, min(args.num_prompts, 2 * args.concurrency))
    samples, tokenizer = serve.prepare(warm)
    for mode in MODES:
        result = run_bench(warm, samples, tokenizer, urls[mode])
        print(f"warm-up {mode}: {result['completed']} ok", flush=True)
    runs = []
    for repeat in range(args.repeats):
        bench = bench_args(args, repeat, args.num_prompts)
        samples, tokenizer = serve.prepare(bench)
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            load = os.getloadavg()[0]
            result = run_bench(bench, samples, tokenizer, urls[mode])
            runs.append({
                "mode": mode, "repeat": repeat, "completed": result["completed"],
                "failed": result["failed"], "duration_s": result["duration"],
                "output_throughput": result["output_throughput"],
                "request_throughput": result["request_throughput"],
                "median_ttft_ms": result.get("median_ttft_ms"),
                "median_itl_ms": result.get("median_itl_ms"),
                "loadavg_1min": [load, os.getloadavg()[0]],
            })  # fmt: skip
            print(
                f"rep={repeat} tracing {mode}: {result['output_throughput']:.1f} tok/s, "
                f"{result['completed']} ok, {result['failed']} failed, load {load:.1f}",
                flush=True,
            )
    return runs


def summarize(runs: Sequence[dict[str, Any]], spans: int, sent: int) -> dict[str, Any]:
    medians = {
        m: statistics.median(r["output_throughput"] for r in runs if r["mode"] == m) for m in MODES
    }
    ratio = medians["on"] / medians["off"] if medians["off"] else None
    return {
        "median_output_throughput": medians,
        "ratio_on_over_off": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio is not None and ratio >= TARGET_RATIO,
        "spans_received": spans,
        "requests_sent_to_traced_server": sent,
        "failed_requests": sum(r["failed"] for r in runs),
    }


def markdown(summary: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    med = summary["median_output_throughput"]
    lines = [
        "| tracing | median output tok/s | runs (tok/s) |",
        "|---|---|---|",
        *(
            f"| {m} | {med[m]:.1f} | "
            + ", ".join(f"{r['output_throughput']:.1f}" for r in runs if r["mode"] == m)
            + " |"
            for m in MODES
        ),
        "",
        f"ratio on/off: {summary['ratio_on_over_off']:.4f} (target >= {TARGET_RATIO}: "
        f"{'met' if summary['meets_target'] else 'NOT met'}); spans received "
        f"{summary['spans_received']} for {summary['requests_sent_to_traced_server']} requests",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="HF model folder (default: the built-in one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    # float32: on CPUs without AVX512-BF16 a bf16 matmul is emulated (far slower)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads per server")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--start-timeout", type=float, default=600.0)
    stamp = datetime.date.today().isoformat()
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         f"tracing_overhead-{stamp}.json"))  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from kvserve.model.builtin import resolve_model

        args.model = str(resolve_model(None)[0])  # converts the GGUF on first use
    receiver = Receiver()
    out = Path(args.out)
    (out.parent / "logs").mkdir(parents=True, exist_ok=True)
    servers, urls = {}, {}
    for mode in MODES:
        port = free_port()
        endpoint = receiver.url if mode == "on" else None
        servers[mode] = ServerProcess(
            server_cmd(args, port, endpoint), out.parent / "logs" / f"tracing_{mode}.log"
        )
        servers[mode].start()
        urls[mode] = f"http://127.0.0.1:{port}"
    doc: dict[str, Any] = {"machine": machine_info(), "settings": vars(args)}
    try:
        for mode in MODES:
            servers[mode].wait_healthy(urls[mode], args.start_timeout)
        runs = measure(args, urls)
    finally:
        for proc in servers.values():
            proc.stop()  # SIGTERM: the traced server exports the spans still queued
    warm_up = min(args.num_prompts, 2 * args.concurrency)
    sent = warm_up + args.repeats * args.num_prompts
    doc |= {"runs": runs, "summary": summarize(runs, receiver.num_spans(), sent)}
    serve.save_result(doc, out)
    print(markdown(doc["summary"], runs))
    print(f"Saved {out}")
    return 0 if doc["summary"]["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
