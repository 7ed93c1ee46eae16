"""Where a decode step's time goes: a torch profile of steady-state steps of the 160M model.

Adds ``--batch`` requests of 30 random tokens, runs the prefill and ``--warm-steps`` decode
steps (context 30 + warm steps), then profiles ``--steps`` decode steps and prints ms per
step and the top operators by self CPU time.

    python benchmarks/profile_step.py --batch 128 --warm-steps 64
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from run_peers import make_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-llama160m")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12, help="operators to print")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (Path(args.model_dir) / "config.json").exists():
        make_model(Path(args.model_dir))
    llm = LLM(args.model_dir, dtype="bfloat16", kv_cache_memory="2GiB", max_num_seqs=256)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1 + args.warm_steps + args.steps + 1)
    for i in range(args.batch):
        prompt = [rng.randrange(100, 32000) for _ in range(30)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(1 + args.warm_steps):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = time.perf_counter() - t0
    print(
        f"batch {args.batch}, context ~{30 + args.warm_steps}: "
        f"{elapsed / args.steps * 1e3:.1f} ms/step (profiled)"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
