"""What ``kvserve::lora_add`` (``csrc/lora_ops.cpp``) costs one decode step: the built-in
model's seven adapted projections (fused q/k/v, o, fused gate/up, down) at a batch spread
over ``--slots`` adapters, rank ``--rank``, timed per call (median of ``--repeats``) and
summed over the model's 30 layers, beside the multiply-adds it does (GFLOP/s).

    python benchmarks/lora_kernel.py                       # bf16, batch 32, 4 adapters
    python benchmarks/lora_kernel.py --dtype float32 --batch 1,32 --slots 1,4,16

The kernel build is this CPU's (``torch.ops.kvserve.lora_isa()`` says which path);
``KVSERVE_CPU_ISA=avx2`` times the AVX2 build on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.ops import cpu_kernels

# SmolLM2-135M: hidden 576, intermediate 1536, 3 KV heads of 64; (K, output slices)
SHAPES = {
    "qkv": (576, (576, 192, 192)),
    "o": (576, (576,)),
    "gate_up": (576, (1536, 1536)),
    "down": (1536, (576,)),
}
LAYERS = 30


def time_call(t: int, slots: int, rank: int, dtype: torch.dtype, repeats: int) -> dict:
    """Per projection: median µs a call and GFLOP/s; the layer's sum; the step's (x 30)."""
    gen = torch.Generator().manual_seed(0)
    token_slots = torch.arange(t) % slots  # [T] every adapter on an equal share of rows
    out: dict = {"calls": {}}
    total_s, total_mac = 0.0, 0
    for name, (k, ns) in SHAPES.items():
        x = torch.randn(t, k, generator=gen).to(dtype)  # [T, K]
        a = (torch.randn(slots, len(ns) * rank, k, generator=gen) * 0.05).to(dtype)
        bts = [(torch.randn(slots, rank, n, generator=gen) * 0.05).to(dtype) for n in ns]
        acc = torch.zeros(t, sum(ns), dtype=dtype)  # [T, sum N]
        for _ in range(10):
            cpu_kernels.lora_add(acc, x, a, bts, token_slots)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cpu_kernels.lora_add(acc, x, a, bts, token_slots)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        mac = t * (len(ns) * rank * k + rank * sum(ns))
        out["calls"][name] = {"us": med * 1e6, "gflops": 2 * mac / med / 1e9}
        total_s, total_mac = total_s + med, total_mac + mac
    out["layer_us"] = total_s * 1e6
    out["step_ms"] = total_s * LAYERS * 1e3
    out["gflops"] = 2 * total_mac / total_s / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", default="32", help="comma list of rows a call")
    ap.add_argument("--slots", default="4", help="comma list of distinct adapters")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the C++ kernels are not built on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"lora_add path: {torch.ops.kvserve.lora_isa()}, {torch.get_num_threads()} threads, "
          f"{args.dtype}, rank {args.rank}")  # fmt: skip
    for t in (int(b) for b in args.batch.split(",")):
        for s in (int(v) for v in args.slots.split(",")):
            r = time_call(t, s, args.rank, dtype, args.repeats)
            calls = "  ".join(f"{n} {c['us']:.1f} us" for n, c in r["calls"].items())
            print(f"batch {t:3d} adapters {s:2d}: {r['step_ms']:6.2f} ms a step "
                  f"({r['gflops']:5.1f} GFLOP/s)  {calls}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
