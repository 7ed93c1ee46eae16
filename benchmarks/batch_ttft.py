"""Online TTFT with and without a Batch API job running (issue 36).

Starts ``kvserve serve`` (the built-in model unless --model) and, ``--rounds`` times, measures
the time to the first streamed token of ``--requests`` sequential online chat requests on an
idle server, then again while a batch job of ``--lines`` long completions runs
(``--batch-max-concurrency`` lines in flight), then cancels the job and waits for the engine to
be idle. Alternating the two conditions puts the slow spells of a shared machine on both.
Prints the medians and their ratio, the server's ``num_background_rows_held_total`` (batch rows
that sat out a step computing an online prompt) and ``num_background_steps_interrupted_total``
(steps given up for an online request: batch rows only, or online rows all aborted) in both
conditions, and writes JSON with ``--out``. ``--server-args`` adds ``kvserve serve`` flags
(``"--dtype float32"``); the server inherits the environment (``KVSERVE_CPU_ISA=avx2``).

    python benchmarks/batch_ttft.py --rounds 3 --requests 10 --batch-max-concurrency 4 \
        --out benchmarks/results/batch_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402

MODEL = "m"
# steps given up for an online request (absent on servers before that: 0)
INTERRUPTED = "kvserve:num_background_steps_interrupted_total"


def _start(args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = 18000 + int(time.time()) % 1000
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--batch-dir", str(folder / "batch"),
           "--batch-max-concurrency", str(args.batch_max_concurrency),
           "--served-model-name", MODEL, *shlex.split(args.server_args)]  # fmt: skip
    log = (folder / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit((folder / "server.log").read_text()[-2000:])
        time.sleep(0.5)


def _ttfts(client: openai.OpenAI, n: int, offset: int, gap: float = 0.0) -> list[float]:
    """TTFTs of ``n`` sequential streamed chats, each closed at its first token; ``gap``: a
    pause of up to that many seconds (seeded) before each, so a request arrives at a random
    moment of the engine's work rather than right behind the previous one, which is still
    being aborted and would share the step in flight."""
    out = []
    pauses = random.Random(offset)
    for i in range(offset, offset + n):
        time.sleep(pauses.uniform(0, gap))
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}"}],
            max_tokens=8, temperature=0, stream=True,
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(time.perf_counter() - start)
                break
        stream.close()
    return out


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and f'model_name="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_idle(url: str) -> None:
    while _metric(url, "kvserve:num_requests_running") or _metric(
        url, "kvserve:num_requests_waiting"
    ):
        time.sleep(0.2)


def _batch_round(client: openai.OpenAI, url: str, args: argparse.Namespace, r: int) -> dict:
    """TTFTs while a job runs (from its second finished line on), then cancel it."""
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
              "body": {**body, "prompt": f"Batch line {i} of round {r} says"}}
             for i in range(args.lines)]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="24h")  # fmt: skip
    while client.batches.retrieve(b.id).request_counts.completed < 2:
        time.sleep(0.2)
    held = _metric(url, "kvserve:num_background_rows_held_total")
    cut = _metric(url, INTERRUPTED)
    busy = _ttfts(client, args.requests, 1000 * r + 500, args.gap)
    held = _metric(url, "kvserve:num_background_rows_held_total") - held
    cut = _metric(url, INTERRUPTED) - cut
    done = client.batches.retrieve(b.id).request_counts.completed
    client.batches.cancel(b.id)
    while client.batches.retrieve(b.id).status not in ("cancelled", "completed"):
        time.sleep(0.2)
    _wait_idle(url)
    return {"ttft": busy, "rows_held": held, "steps_interrupted": cut, "lines_done": done}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--lines", type=int, default=400)
    p.add_argument("--batch-max-concurrency", type=int, default=4)
    p.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="random pause of up to this many seconds before each online request",
    )
    p.add_argument("--server-args", default="", help="extra kvserve serve flags")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    alone: list[float] = []
    busy: list[float] = []
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(args, Path(tmp))
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
            _ttfts(client, 3, 0)  # warm
            for r in range(args.rounds):
                cut = _metric(url, INTERRUPTED)
                a = _ttfts(client, args.requests, 1000 * r, args.gap)
                cut = _metric(url, INTERRUPTED) - cut
                b = _batch_round(client, url, args, r)
                alone += a
                busy += b["ttft"]
                rounds.append({"alone": a, "alone_steps_interrupted": cut, **b})
                print(f"round {r}: alone {statistics.median(a) * 1000:.1f} ms "
                      f"({cut:.0f} steps given up), "
                      f"batch {statistics.median(b['ttft']) * 1000:.1f} ms, "
                      f"rows held {b['rows_held']:.0f}, "
                      f"steps given up {b['steps_interrupted']:.0f}", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    a, m = statistics.median(alone), statistics.median(busy)
    print(f"online TTFT median: alone {a * 1000:.1f} ms, during a batch {m * 1000:.1f} ms "
          f"({m / a:.2f}x)")  # fmt: skip
    if args.out is not None:
        result = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
            "ttft_alone_median_s": a, "ttft_batch_median_s": m, "ratio": m / a,
            "rounds": rounds,
        }  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
