"""Decode speed per OpenMP wait policy, quiet and beside a co-running busy process.

Each policy needs its own process (libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once,
when torch loads it). A child loads ``kvserve.LLM`` (the built-in model, greedy), then times
short generations at batch 1 and 8, alternately quiet and with ``python -c 'while True: pass'``
pinned to the last allowed core (started and stopped by the child around each timing). The
parent runs the policies in rotated order ``--rounds`` times and prints medians of ms per
decode step (wall time of a generation / its output tokens per sequence).

    python benchmarks/omp_wait_policy.py --rounds 2 --reps 1 --out results.json
    python benchmarks/omp_wait_policy.py --policies PASSIVE@auto PASSIVE@nobind  # binding
    python benchmarks/omp_wait_policy.py --policies PASSIVE spin1k --busy 4  # oversubscribed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import machine_info, run_paths

POLICIES: dict[str, dict[str, str]] = {
    "default": {},  # libgomp's own: spin ~300k iterations, then sleep
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},  # sleep at once
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},  # spin (almost) forever
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},  # ~a microsecond: the gap between a step's regions
}
BUSY = "while True: pass"


def start_busy(n: int, core: int) -> list[subprocess.Popen[bytes]]:
    """One busy process pinned to ``core``, or ``n`` > 1 unpinned (an oversubscribed host)."""
    pin = (lambda: os.sched_setaffinity(0, {core})) if n == 1 else None
    return [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=pin) for _ in range(n)]


def child(tokens: int, reps: int, cpu_cores: str | None, busy: int) -> None:
    from kvserve import LLM, SamplingParams

    kwargs = {} if cpu_cores is None else {"cpu_cores": cpu_cores}
    llm = LLM(None, **kwargs)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    busy_core = max(os.sched_getaffinity(0))
    llm.generate(["Warm up the engine"] * 8, params, use_tqdm=False)
    results: dict[str, list[float]] = {}
    for _ in range(reps):
        for load in ("quiet", "busy"):
            procs = start_busy(busy, busy_core) if load == "busy" else []
            if procs:
                time.sleep(0.3)
            try:
                for batch in (1, 8):
                    t0 = time.perf_counter()
                    llm.generate(["The history of the city"] * batch, params, use_tqdm=False)
                    ms = (time.perf_counter() - t0) * 1000 / tokens
                    results.setdefault(f"{load} b{batch}", []).append(ms)
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    print("PATHS " + json.dumps(run_paths(llm)), flush=True)
    print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="quiet/busy alternations per child")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        help="names from POLICIES, each optionally @CORES (its --cpu-cores)",
    )
    ap.add_argument("--cpu-cores", default=None, help="passed to LLM(cpu_cores=...)")
    ap.add_argument("--busy", type=int, default=1,
                    help="busy processes in the busy phase: 1 pinned to the last core, or "
                    "N > 1 unpinned (an oversubscribed host)")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.reps, args.cpu_cores, args.busy)
        return
    runs: dict[str, dict[str, list[float]]] = {p: {} for p in args.policies}
    paths: dict[str, str] = {}
    for r in range(args.rounds):
        order = args.policies[r % len(args.policies) :] + args.policies[: r % len(args.policies)]
        for policy in order:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}  # fmt: skip
            name, _, cores = policy.partition("@")  # PASSIVE@nobind: with --cpu-cores nobind
            env.update(POLICIES[name])
            cmd = [sys.executable, __file__, "--child", "--reps", str(args.reps),
                   "--tokens", str(args.tokens), "--busy", str(args.busy)]  # fmt: skip
            if cores or args.cpu_cores is not None:
                cmd += ["--cpu-cores", cores or args.cpu_cores]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            paths[policy] = next(x for x in out.stdout.splitlines() if x.startswith("PATHS "))
            line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
            for key, values in json.loads(line[len("RESULT ") :]).items():
                runs[policy].setdefault(key, []).extend(values)
            print(f"round {r} {policy}: {line[7:]}", flush=True)
    table = {p: {k: statistics.median(v) for k, v in d.items()} for p, d in runs.items()}
    keys = sorted(next(iter(table.values())))
    print("policy     " + "  ".join(f"{k:>12}" for k in keys))
    for policy, row in table.items():
        print(f"{policy:10} " + "  ".join(f"{row[k]:12.1f}" for k in keys))
    if args.out:
        doc = {
            "machine": machine_info(), "ms_per_step_median": table, "samples": runs,
            "run_paths": {p: json.loads(line[len("PATHS ") :]) for p, line in paths.items()},
        }  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
