"""gRPC streaming against HTTP SSE: the same server, the same requests, at concurrency 1 and 64.

One ``kvserve serve --grpc-port`` process (default: the built-in SmolLM2-135M-Instruct) serves
both APIs from one engine. ``kvserve bench serve`` drives it in this process with
``--backend openai`` (``/v1/completions`` streamed as SSE over aiohttp, one connection per
request in flight) and ``--backend grpc`` (``GenerateStream`` over one grpc.aio channel, every
call multiplexed on its HTTP/2 connection): each is how its client is normally used. The
workload is random prompts of ``--input-len`` tokens, ``--output-len`` tokens each
(``ignore_eos``), greedy, closed loop at the concurrency; both backends get the identical
prompts (the same dataset seed) in a repeat, alternating which goes first, and each repeat
uses a new seed. Reported per (concurrency, backend), medians over ``--repeats``: TTFT and ITL
(mean, median, p99, ms), TPOT and output tokens/s, plus gRPC / HTTP ratios. Issue 18 asks for
the comparison, with no target.

Writes ``benchmarks/results/grpc_vs_http-<date>.json`` (every run, medians, settings, the
server command, machine) and prints a markdown table.

    python benchmarks/grpc_vs_http.py                                   # the measurement
    python benchmarks/grpc_vs_http.py --c1-requests 4 --c64-requests 64 --repeats 1 \\
        --output-len 32 --out /tmp/grpc_vs_http.json                    # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `benchmarks` importable

from benchmarks.machine import machine_info, server_run_paths  # noqa: E402
from kvserve.bench import serve  # noqa: E402
from kvserve.bench.sweep import ServerProcess, free_port  # noqa: E402

BACKENDS = {"http-sse": "openai", "grpc": "grpc"}  # label -> bench serve --backend
CONCURRENCIES = (1, 64)
METRICS = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_tpot_ms", "output_throughput", "request_throughput",
)  # fmt: skip
WARMUP_SEED = 10_000  # measured runs use 1000 * concurrency + repeat


def server_command(args: argparse.Namespace, port: int, grpc_port: int) -> list[str]:
    return [
        sys.executable, "-m", "kvserve.cli", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--dtype", args.dtype, "--max-num-seqs", str(max(CONCURRENCIES)),
        "--kv-cache-memory", args.kv_cache_memory, "--no-access-log",
        # Both backends send the same prompts to this one server: with prefix caching the
        # second of each pair found the first's prompts cached (TTFT 87 vs 266 ms at c=1).
        "--no-enable-prefix-caching",
        *(["--num-threads", str(args.threads)] if args.threads else []),
    ]  # fmt: skip


def bench_args(
    args: argparse.Namespace, backend: str, concurrency: int, num_prompts: int, seed: int
) -> argparse.Namespace:
    """``bench serve``'s options for one run (the URL is added by ``run``)."""
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser.parse_args([
        "--backend", backend, "--grpc-port", str(args.grpc_port), "--tokenizer", args.model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--metrics-interval", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
    ])  # fmt: skip


def run(bench: argparse.Namespace, url: str) -> dict[str, Any]:
    bench.base_url = url
    samples, tokenizer = serve.prepare(bench)
    return asyncio.run(serve.benchmark(bench, samples, tokenizer))


def measure(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    """Every concurrency x repeat x backend, the backends' order alternating per repeat."""
    runs = []
    for concurrency in CONCURRENCIES:
        n = args.c1_requests if concurrency == 1 else args.c64_requests
        for repeat in range(args.repeats):
            labels = list(BACKENDS) if repeat % 2 == 0 else list(BACKENDS)[::-1]
            for label in labels:
                seed = 1000 * concurrency + repeat  # the same prompts for both backends
                load = os.getloadavg()[0]
                result = run(bench_args(args, BACKENDS[label], concurrency, n, seed), url)
                record = {
                    "backend": label, "concurrency": concurrency, "repeat": repeat,
                    "completed": result["completed"], "failed": result["failed"],
                    "total_output_tokens": result["total_output_tokens"],
                    "loadavg_1min": [load, os.getloadavg()[0]],
                    **{k: result.get(k) for k in METRICS},
                }  # fmt: skip
                runs.append(record)
                print(
                    f"  c={concurrency:<2} rep={repeat} {label:<8}: TTFT p50 "
                    f"{record['median_ttft_ms'] or 0:.1f} ms, ITL p50 "
                    f"{record['median_itl_ms'] or 0:.1f} ms, "
                    f"{record['output_throughput']:.1f} tok/s, failed {record['failed']}",
                    flush=True,
                )
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats per concurrency and backend, and gRPC / HTTP ratios."""
    out: dict[str, Any] = {}
    for c in CONCURRENCIES:
        entry: dict[str, Any] = {}
        for label in BACKENDS:
            mine = [r for r in runs if r["concurrency"] == c and r["backend"] == label]
            entry[label] = {
                k: statistics.median(r[k] for r in mine if r[k] is not None)
                for k in METRICS
                if any(r[k] is not None for r in mine)
            }
            entry[label]["failed"] = sum(r["failed"] for r in mine)
        http, grpc_ = entry["http-sse"], entry["grpc"]
        entry["grpc_over_http"] = {
            k: grpc_[k] / http[k] for k in METRICS if k in http and k in grpc_ and http[k]
        }
        out[str(c)] = entry
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| concurrency | API | TTFT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) "
        "| TPOT mean (ms) | output tok/s | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, entry in summary.items():
        for label in BACKENDS:
            m = entry[label]

            def f(key: str, m: dict[str, Any] = m) -> str:
                return f"{m[key]:.1f}" if key in m else "-"

            lines.append(
                f"| {c} | {label} | {f('mean_ttft_ms')} / {f('median_ttft_ms')} / "
                f"{f('p99_ttft_ms')} | {f('mean_itl_ms')} / {f('median_itl_ms')} / "
                f"{f('p99_itl_ms')} | {f('mean_tpot_ms')} | {f('output_throughput')} "
                f"| {m['failed']} |"
            )
        ratio = entry["grpc_over_http"]
        lines.append(
            f"| {c} | gRPC / HTTP | TTFT p50 x{ratio.get('median_ttft_ms', 0):.2f} | "
            f"ITL p50 x{ratio.get('median_itl_ms', 0):.2f} | "
            f"x{ratio.get('mean_tpot_ms', 0):.2f} | x{ratio.get('output_throughput', 0):.2f} | |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="server torch threads")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--c1-requests", type=int, default=16, help="requests at concurrency 1")
    ap.add_argument("--c64-requests", type=int, default=256, help="requests at concurrency 64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=600.0, help="server start, s")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from kvserve.model.builtin import resolve_model

        args.model = str(resolve_model(None)[0])  # converts the GGUF on first use
    date = datetime.date.today().isoformat()
    out = Path(args.out or REPO / "benchmarks" / "results" / f"grpc_vs_http-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    port, args.grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, port, args.grpc_port)
    proc = ServerProcess(cmd, out.with_suffix(".server.log"))
    doc: dict[str, Any] = {"benchmark": "grpc_vs_http", "machine": machine_info()}
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(url, args.start_timeout)
        doc["run_paths"] = server_run_paths(url)  # fused ops, decode loop, ISA, threads
        for label, backend in BACKENDS.items():  # first connections, kernels, caches
            result = run(bench_args(args, backend, 8, 16, WARMUP_SEED), url)
            print(f"warm-up {label}: {result['completed']} ok, {result['failed']} failed")
        runs = measure(args, url)
    finally:
        proc.stop()
    summary = summarize(runs)
    table = markdown(summary)
    print()
    print(table)
    doc.update(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        wall_time_s=time.monotonic() - t0,
        server_command=" ".join(cmd),
        settings=vars(args),
        summary=summary,
        runs=runs,
        markdown=table,
    )
    serve.save_result(doc, out)
    print(f"\nSaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
