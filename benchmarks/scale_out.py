"""Scale-out: plain ``kvserve serve`` against Ray Serve with 1 and 2 engine replicas.

Each setup is one server process started here, driven by ``kvserve bench serve`` (the
``openai`` backend: ``/v1/completions`` streamed as SSE) with random prompts of
``--input-len`` tokens, ``--output-len`` tokens each (``ignore_eos``), greedy, closed loop at
concurrency 1 and 64:

* ``plain``   — ``kvserve serve --num-threads T`` (no Ray): one engine, one process.
* ``ray-1x``  — ``kvserve serve --ray --num-replicas 1 --num-threads T``: the same engine
  behind Serve's HTTP proxy and the kvserve ingress (two extra hops per request).
* ``ray-2x``  — ``--num-replicas 2``: two engines of T threads each, requests spread by the
  router (``--routing-policy``, least_loaded here: random prompts share no prefix).
* ``tp2`` / ``tp3`` — ``kvserve serve --tensor-parallel-size 2`` (3): one engine whose model
  is sharded over 2 (3) worker processes of T threads each; its ITL minus ``plain``'s is the
  all-reduce cost per step. Not in the default ``--setups``: the built-in SmolLM2-135M
  (9 query / 3 K/V heads) shards over 3 ranks only, so ``tp2`` needs ``--model`` with heads
  divisible by 2.

Reported per (setup, concurrency), medians over ``--repeats``: output tokens/s, requests/s,
TTFT and ITL (mean/median/p99, ms), and the CPU the server used (every process of the
server: the driver, Ray's raylet/GCS/proxy/controller/ingress and the replicas), as output
tokens per CPU-second: on a machine with fewer cores than the setups use, "per core" is what
compares. The Ray hop's TTFT cost is ray-1x minus plain at concurrency 1. Prefix caching is
off (every run sends new random prompts anyway; this keeps repeats independent).

Writes ``benchmarks/results/scale_out-<date>.json`` and prints a markdown table.

    python benchmarks/scale_out.py                      # the measurement (a quiet machine)
    python benchmarks/scale_out.py --quick              # a smoke run: a few short requests
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

from benchmarks.machine import machine_info  # noqa: E402
from kvserve.bench import serve  # noqa: E402
from kvserve.bench.sweep import ServerProcess, free_port  # noqa: E402

SETUPS = {"plain": None, "ray-1x": 1, "ray-2x": 2}  # name -> Ray replicas (None: no Ray)
TP_SETUPS = {"tp2": 2, "tp3": 3}  # name -> tensor_parallel_size (no Ray)
CONCURRENCIES = (1, 64)
METRICS = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_tpot_ms", "output_throughput", "request_throughput",
)  # fmt: skip
WARMUP_SEED = 10_000


def server_command(args: argparse.Namespace, setup: str, port: int) -> list[str]:
    replicas = SETUPS.get(setup)
    cmd = [
        sys.executable, "-m", "kvserve.cli", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
        "--num-threads", str(args.threads), "--max-num-seqs", str(max(CONCURRENCIES)),
        "--kv-cache-memory", args.kv_cache_memory, "--no-access-log",
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    if setup in TP_SETUPS:  # --num-threads is per rank
        cmd += ["--tensor-parallel-size", str(TP_SETUPS[setup])]
    if replicas is not None:
        cmd += ["--ray", "--num-replicas", str(replicas), "--routing-policy", "least_loaded",
                "--stream-batching-interval-ms", str(args.stream_batching_interval_ms)]  # fmt: skip
    return cmd


def server_cpu_seconds(proc: ServerProcess) -> float | None:
    """User + system CPU of the server process and all its descendants so far (None without
    psutil). Ray's processes (raylet, GCS, workers) are children of the server's driver."""
    try:
        import psutil
    except ImportError:
        return None
    assert proc.proc is not None
    total = 0.0
    try:
        root = psutil.Process(proc.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass  # exited meanwhile
    except psutil.Error:
        return None
    return total


def bench_args(
    args: argparse.Namespace, concurrency: int, num_prompts: int, seed: int
) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--tokenizer", args.model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
    ])  # fmt: skip


def run(bench: argparse.Namespace, url: str) -> dict[str, Any]:
    bench.base_url = url
    samples, tokenizer = serve.prepare(bench)
    return asyncio.run(serve.benchmark(bench, samples, tokenizer))


def measure_setup(args: argparse.Namespace, setup: str, out: Path) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, setup, port)
    proc = ServerProcess(cmd, out.with_suffix(f".{setup}.server.log"))
    runs = []
    started = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(url, args.start_timeout)
        startup_s = time.monotonic() - started
        warm = run(bench_args(args, 8, args.warmup_requests, WARMUP_SEED), url)
        print(f"{setup}: up in {startup_s:.0f} s; warm-up {warm['completed']} ok", flush=True)
        for concurrency in CONCURRENCIES:
            n = args.c1_requests if concurrency == 1 else args.c64_requests
            for repeat in range(args.repeats):
                cpu0, load0 = server_cpu_seconds(proc), os.getloadavg()[0]
                result = run(bench_args(args, concurrency, n, 1000 * concurrency + repeat), url)
                cpu1 = server_cpu_seconds(proc)
                cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
                tokens = result["total_output_tokens"]
                record = {
                    "setup": setup, "concurrency": concurrency, "repeat": repeat,
                    "startup_s": startup_s, "completed": result["completed"],
                    "failed": result["failed"], "total_output_tokens": tokens,
                    "duration_s": result.get("duration"), "server_cpu_s": cpu,
                    "tokens_per_cpu_s": tokens / cpu if cpu else None,
                    "loadavg_1min": [load0, os.getloadavg()[0]],
                    **{k: result.get(k) for k in METRICS},
                }  # fmt: skip
                runs.append(record)
                print(
                    f"  {setup:<7} c={concurrency:<2} rep={repeat}: "
                    f"{record['output_throughput']:.1f} tok/s, TTFT p50 "
                    f"{record['median_ttft_ms'] or 0:.1f} ms, ITL p50 "
                    f"{record['median_itl_ms'] or 0:.1f} ms, "
                    f"{record['tokens_per_cpu_s'] or 0:.1f} tok/CPU-s, failed {record['failed']}",
                    flush=True,
                )  # fmt: skip
    finally:
        proc.stop(grace_s=30.0)
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per (setup, concurrency), and the Ray hop's TTFT cost at concurrency 1."""
    keys = (*METRICS, "tokens_per_cpu_s", "server_cpu_s")
    out: dict[str, Any] = {}
    for setup in dict.fromkeys(r["setup"] for r in runs):
        for c in CONCURRENCIES:
            mine = [r for r in runs if r["setup"] == setup and r["concurrency"] == c]
            if not mine:
                continue
            entry = {
                k: statistics.median(r[k] for r in mine if r[k] is not None)
                for k in keys
                if any(r[k] is not None for r in mine)
            }
            entry["failed"] = sum(r["failed"] for r in mine)
            out[f"{setup}@{c}"] = entry
    plain, ray1 = out.get("plain@1", {}), out.get("ray-1x@1", {})
    if "median_ttft_ms" in plain and "median_ttft_ms" in ray1:
        out["ray_hop_ttft_ms"] = ray1["median_ttft_ms"] - plain["median_ttft_ms"]
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| setup | concurrency | output tok/s | tok / CPU-s | req/s | TTFT mean / p50 / p99 "
        "(ms) | ITL mean / p50 / p99 (ms) | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, m in summary.items():
        if "@" not in key:
            continue
        setup, c = key.split("@")

        def f(k: str, m: dict[str, Any] = m) -> str:
            return f"{m[k]:.1f}" if k in m else "-"

        lines.append(
            f"| {setup} | {c} | {f('output_throughput')} | {f('tokens_per_cpu_s')} | "
            f"{m.get('request_throughput', 0):.2f} | {f('mean_ttft_ms')} / "
            f"{f('median_ttft_ms')} / {f('p99_ttft_ms')} | {f('mean_itl_ms')} / "
            f"{f('median_itl_ms')} / {f('p99_itl_ms')} | {m['failed']} |"
        )
    if "ray_hop_ttft_ms" in summary:
        lines.append(f"\nRay hop, TTFT p50 at concurrency 1: {summary['ray_hop_ttft_ms']:+.1f} ms")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in)")
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"of {[*SETUPS, *TP_SETUPS]}")  # fmt: skip
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="per engine")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stream-batching-interval-ms", type=float, default=0.0,
                    help="Ray setups: the replicas' stream batching (0: every step)")  # fmt: skip
    ap.add_argument("--c1-requests", type=int, default=16, help="requests at concurrency 1")
    ap.add_argument("--c64-requests", type=int, default=256, help="requests at concurrency 64")
    ap.add_argument("--warmup-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 + 16 requests of 16 tokens, 1 repeat")  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=600.0, help="server start, s")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.c1_requests, args.c64_requests, args.repeats = 2, 16, 1
        args.input_len, args.output_len, args.warmup_requests = 32, 16, 4
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS and s not in TP_SETUPS]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from {[*SETUPS, *TP_SETUPS]}")
    if args.model is None:
        from kvserve.model.builtin import resolve_model

        args.model = str(resolve_model(None)[0])  # converts the GGUF on first use
    date = datetime.date.today().isoformat()
    out = Path(args.out or REPO / "benchmarks" / "results" / f"scale_out-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Every setup's engines run --threads OpenMP threads. Ray replicas get OMP_NUM_THREADS from
    # their deployment; the plain server needs it too: torch.set_num_threads applies to the
    # thread that calls it, and the engine thread's OpenMP kernels otherwise use one thread
    # per core (measured here: plain ITL p50 29 ms without it, 16 ms for the Ray replica).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    t0 = time.monotonic()
    runs = [r for setup in setups for r in measure_setup(args, setup, out)]
    summary = summarize(runs)
    table = markdown(summary)
    print()
    print(table)
    doc = {
        "benchmark": "scale_out",
        "machine": machine_info(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_time_s": time.monotonic() - t0,
        "server_commands": {s: " ".join(server_command(args, s, 0)) for s in setups},
        "settings": vars(args),
        "summary": summary,
        "runs": runs,
        "markdown": table,
    }
    serve.save_result(doc, out)
    print(f"\nSaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
