"""Cost of fresh pages for large step buffers, with and without kvserve's malloc tuning.

Runs one 3840-row gate/up projection of the 160M model (a 30-token x 128-prompt prefill)
in a loop after an engine with a 2 GiB KV cache is built, and prints ms per call, minor
page faults per call and system time per call. Each setting runs in its own process since
mallopt settings cannot be undone:

    python benchmarks/page_faults.py
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def probe(model_dir: str, calls: int) -> None:
    import torch

    from kvserve import LLM

    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory="2GiB", max_num_batched_tokens=4096)
    modules = llm.engine.runner.model.named_modules()
    gate_up = next(m for n, m in modules if n.endswith("gate_up_proj"))
    x = torch.randn(3840, gate_up.in_features, dtype=torch.bfloat16)
    gate_up(x)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(calls):
        gate_up(x)
    dt, r1 = (time.perf_counter() - t0) / calls, resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"  KVSERVE_MALLOC_TUNING={os.environ.get('KVSERVE_MALLOC_TUNING', '1')}: "
        f"{dt * 1e3:.1f} ms/call, {(r1.ru_minflt - r0.ru_minflt) / calls:.0f} faults/call, "
        f"{(r1.ru_stime - r0.ru_stime) / calls * 1e3:.1f} ms system time/call"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-llama160m")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        return probe(args.model_dir, args.calls)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from run_peers import make_model

    if not (Path(args.model_dir) / "config.json").exists():
        make_model(Path(args.model_dir))
    print("3840-row gate/up projection (bf16, 2 threads):")
    for _ in range(args.repeats):
        for tuning in ("0", "1"):
            env = dict(os.environ, KVSERVE_MALLOC_TUNING=tuning)
            cmd = [sys.executable, __file__, "--probe", "--model-dir", args.model_dir]
            subprocess.run([*cmd, "--calls", str(args.calls)], env=env, check=True)


if __name__ == "__main__":
    main()
