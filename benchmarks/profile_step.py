"""Where a decode step's time goes: a torch profile of steady-state steps.

Adds ``--batch`` requests (30 random tokens each, or ``--longtail``: log-normal lengths as
``peers/run_http.py``'s long-tailed prompts, median ~60 tokens, tail to 1,000), runs the
prefill and ``--warm-steps`` decode steps, then profiles ``--steps`` decode steps and prints
ms per step, the engine's phases (schedule, prepare, forward, sample, output), the operators
grouped (linears, attention, sampling, the rest) and the top operators by self CPU time.

    python benchmarks/profile_step.py --batch 128 --warm-steps 64
    # issue 31: the TinyLlama-1.1B shape, float32 on bf16-stored weights, batch 32
    python benchmarks/profile_step.py --shape tinyllama --dtype float32 --batch 32 \\
        --longtail --warm-steps 8 --steps 6 --threads 2
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
from run_http import make_tinyllama
from run_peers import make_model

# operator name fragments -> group (first match wins)
GROUPS = (
    ("linear", ("wide_linear", "addmm", "aten::mm", "linear", "packed_linear", "quant_linear")),
    ("attention", ("paged", "attention", "sdpa")),
    ("sampling", ("sampl", "argmax", "topk", "softmax", "multinomial")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def prompt_lengths(n: int, longtail: bool, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if not longtail:
        return [30] * n
    return [min(1000, max(4, int(rng.lognormvariate(4.1, 0.9)))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("llama160m", "tinyllama"), default="llama160m")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weight-dtype", default=None, help="LLM weight_dtype (default auto)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--longtail", action="store_true", help="long-tailed prompt lengths")
    ap.add_argument("--warm-steps", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=12, help="operators to print")
    ap.add_argument("--quantization", default=None, help="LLM quantization (gguf: --model-dir "
                    "a .gguf file)")  # fmt: skip
    ap.add_argument("--quantization-activations", default=None,
                    help="LLM quantization_activations (int8, float; default auto)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or f"/tmp/kvserve-peers-{args.shape}")
    if not model_dir.is_file() and not (model_dir / "config.json").exists():
        (make_tinyllama if args.shape == "tinyllama" else make_model)(model_dir)
    extra = {} if args.weight_dtype is None else {"weight_dtype": args.weight_dtype}
    if args.quantization:
        extra["quantization"] = args.quantization
    if args.quantization_activations:
        extra["quantization_activations"] = args.quantization_activations
    llm = LLM(str(model_dir), dtype=args.dtype, kv_cache_memory="2GiB",
              max_num_seqs=max(args.batch, 1), num_threads=args.threads, **extra)  # fmt: skip
    engine = llm.engine
    rng = random.Random(0)
    lengths = prompt_lengths(args.batch, args.longtail)
    params = SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=1 + args.warm_steps + args.steps + 1)  # fmt: skip
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(100, 32000) for _ in range(n)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):  # prefill (chunked) until every request decodes
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    engine.timings.__init__()  # the profiled steps' phases only
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = time.perf_counter() - t0
    ctx = sum(lengths) / len(lengths) + args.warm_steps
    print(
        f"batch {args.batch}, mean context ~{ctx:.0f} (max {max(lengths) + args.warm_steps}),"
        f" {args.threads} threads: {elapsed / args.steps * 1e3:.1f} ms/step (profiled)"
    )
    phases = engine.timings.as_dict()
    steps = max(1, int(phases.pop("steps")) or args.steps)
    print("phases ms/step: " + ", ".join(f"{k} {v / steps * 1e3:.1f}" for k, v in phases.items()))
    groups: dict[str, float] = {}
    for ev in prof.key_averages():
        g = group_of(ev.key)
        groups[g] = groups.get(g, 0.0) + ev.self_cpu_time_total / 1e3 / args.steps
    print("operator groups, self CPU ms/step: "
          + ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(groups.items())))  # fmt: skip
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
