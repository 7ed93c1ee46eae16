"""Online TTFT with and without a Batch API job running (issue 36).

Starts ``kvserve serve`` (the built-in model unless --model), measures the time to the first
streamed token of ``--requests`` sequential online chat requests on an idle server, then again
while a batch job of ``--lines`` long completions runs (``--batch-max-concurrency``), then
cancels the job. Prints the medians and the ratio.

    python benchmarks/batch_ttft.py --requests 20 --lines 400 --batch-max-concurrency 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai


def _start(args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = 18000 + int(time.time()) % 1000
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--batch-dir", str(folder / "batch"),
           "--batch-max-concurrency", str(args.batch_max_concurrency),
           "--served-model-name", "m"]  # fmt: skip
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


def _ttfts(client: openai.OpenAI, n: int) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Tell me about the number {i}"}],
            max_tokens=8, temperature=0, stream=True,
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(time.perf_counter() - start)
                break
        stream.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--lines", type=int, default=400)
    p.add_argument("--batch-max-concurrency", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(args, Path(tmp))
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
            _ttfts(client, 3)  # warm
            alone = _ttfts(client, args.requests)
            body = {"model": "m", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                      "body": {**body, "prompt": f"Batch line {i} says"}}
                     for i in range(args.lines)]  # fmt: skip
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            f = client.files.create(file=("in.jsonl", data), purpose="batch")
            b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
            while client.batches.retrieve(b.id).request_counts.completed < 2:
                time.sleep(0.2)
            busy = _ttfts(client, args.requests)
            during = client.batches.retrieve(b.id)
            client.batches.cancel(b.id)
        finally:
            proc.terminate()
            proc.wait(30)
    a, m = statistics.median(alone), statistics.median(busy)
    print(f"online TTFT median: alone {a * 1000:.1f} ms, during a batch {m * 1000:.1f} ms "
          f"({m / a:.2f}x); batch lines done meanwhile: {during.request_counts.completed}, "
          f"status {during.status}")  # fmt: skip


if __name__ == "__main__":
    main()
