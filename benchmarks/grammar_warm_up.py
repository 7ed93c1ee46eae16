"""What ``--grammar-warm-up`` costs and buys: CPU at start, and the first grammar's latency.

For each mode (the default ``--grammar-warm-up``, then ``--no-grammar-warm-up``), alternating,
``--repeats`` times: start ``kvserve serve`` (built-in model unless ``--model``, one torch
thread), wait for ``/health``, wait ``--settle`` seconds (a warm-up is done by then), read the
CPU seconds (user + system) of the server and of its child processes (the compile zygote and
its workers), then time two ``guided_choice`` chats and one plain chat.

    python benchmarks/grammar_warm_up.py --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvserve.bench.proc_cost import session_usage
from kvserve.bench.sweep import ServerProcess

PORT = 18125


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server process and of the rest of its session (the compile zygote and
    its workers; ``proc_cost``, which also counts reaped children)."""
    own = sum(psutil.Process(pid).cpu_times()[:2])
    usage = session_usage(pid)
    return own, (usage.cpu_seconds - own) if usage is not None else float("nan")


def _chat(url: str, model: str, grammar: bool) -> float:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "max_tokens": 8, "temperature": 0,
    }  # fmt: skip
    if grammar:
        body["structured_outputs"] = {"choice": ["yes", "no"]}
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.monotonic() - t0


def run_once(flag: str, model: list[str], settle: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *model, flag, "--port", str(PORT)]
    url = f"http://127.0.0.1:{PORT}"
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's one torch thread (inherited)
    server = ServerProcess(cmd, Path(tempfile.gettempdir()) / "kvserve-grammar-warm-up.log")
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_healthy(url, timeout_s=300)
        ready = time.monotonic() - t0
        time.sleep(settle)
        own, kids = _cpu(server.pid)
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        first, second = _chat(url, name, True), _chat(url, name, True)
        plain = _chat(url, name, False)
    finally:
        server.stop()
    return {"ready_s": ready, "cpu_server_s": own, "cpu_children_s": kids,
            "first_grammar_s": first, "second_grammar_s": second, "plain_s": plain}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model to serve (default: built-in)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after /health")
    args = ap.parse_args()
    model = [args.model] if args.model else []
    for rep in range(args.repeats):
        for flag in ("--grammar-warm-up", "--no-grammar-warm-up"):
            r = run_once(flag, model, args.settle)
            print(f"rep {rep} {flag:22s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
