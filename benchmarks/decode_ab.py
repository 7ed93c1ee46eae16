"""Decode step time of several weight settings in one process, interleaved (issue 16).

On the 2-core test machines the memory bandwidth moves between phases (45-77 GB/s within a
session), and a server setting measured a minute after another can be 50% faster or slower for
that reason alone. Here every setting is an ``LLM`` in one process, and each repeat times one
single-request decode of every setting in turn (order reversed every other repeat): ratios are
taken within a repeat, so both sides of each ratio saw the same phase. Offline, no HTTP: the
server's own overhead is measured by ``benchmarks/quantization.py``.

    python benchmarks/decode_ab.py --model tinyllama --repeats 15 \\
        --settings bf16,int8,int8-lmhead,int4,int4-lmhead,int4-lmhead-eager
    # AVX512-BF16 CPUs: bf16 linears on the packed layout (vdpbf16ps) against oneDNN's
    python benchmarks/decode_ab.py --model tinyllama --repeats 5 --settings bf16-packed,bf16-onednn
    # AVX2-only CPUs (issue 31): float32 weights against bf16-stored ones
    python benchmarks/decode_ab.py --model tinyllama --repeats 9 \\
        --settings fp32,fp32-bf16w,fp32-unfused

A decode step's time is ``(t(1 + n tokens) - t(1 token)) / n`` for one 128-token prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the repository only: benchmarks/ itself on the path would let benchmarks/kernels.py shadow
# the "kernels" package transformers looks for
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info, run_paths  # noqa: E402

# setting -> LLM keyword arguments (bf16 weights unless quantized; "eager": Python layers;
# fp32: float32 compute, the weights in float32 or stored in bf16 (weight_dtype); fp32-unfused
# is float32 as it ran before the fused float32 ops and decode loop: op chains, Python layers)
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "weight_dtype": "float32"},
    "fp32-bf16w": {"dtype": "float32", "weight_dtype": "bfloat16"},
    "fp32-bf16w-eager": {"dtype": "float32", "weight_dtype": "bfloat16", "enforce_eager": True},
    "fp32-unfused": {"dtype": "float32", "weight_dtype": "float32", "fused_ops": False},
    "bf16": {},
    "bf16-eager": {"enforce_eager": True},
    # a bf16 model's dense linears on one kernel or the other (--cpu-linear-kernel)
    "bf16-packed": {"cpu_linear_kernel": "packed"},
    "bf16-onednn": {"cpu_linear_kernel": "onednn"},
    "int8": {"quantization": "int8"},
    "int8-lmhead": {"quantization": "int8", "quantization_lm_head": True},
    "int4": {"quantization": "int4"},
    "int4-lmhead": {"quantization": "int4", "quantization_lm_head": True},
    "int4-lmhead-eager": {
        "quantization": "int4",
        "quantization_lm_head": True,
        "enforce_eager": True,
    },
}


def parse_settings(text: str) -> list[str]:
    keys = list(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in keys if k not in SETTINGS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown settings {unknown}; choose from {list(SETTINGS)}"
        )
    return keys


def step_ms(llm: Any, prompts: list[dict[str, list[int]]], tokens: int) -> float:
    """One decode step's milliseconds at ``len(prompts)`` rows: a 1 + ``tokens`` generation
    minus a 1-token one."""
    from kvserve import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    return (run(1 + tokens) - run(1)) / tokens * 1000


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median step ms per setting, and per setting the median of its per-repeat speed-ups
    over the baseline, the first setting (baseline ms / setting ms, from the same repeat)."""
    baseline = next(iter(times))
    out: dict[str, Any] = {"median_ms": {k: statistics.median(v) for k, v in times.items()}}
    base = times[baseline]
    out["baseline"] = baseline
    out["speedup"] = {
        k: statistics.median(b / t for b, t in zip(base, v, strict=True))
        for k, v in times.items()
        if k != baseline
    }
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"| setting | decode step ms (median) | x {summary['baseline']} (median of "
             "per-repeat ratios) |", "|---|---|---|"]  # fmt: skip
    for key, ms in summary["median_ms"].items():
        ratio = summary["speedup"].get(key)
        lines.append(f"| {key} | {ms:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tinyllama", help="builtin, tinyllama or a model folder")
    p.add_argument("--settings", type=parse_settings, default=parse_settings(
        "bf16,int8-lmhead,int4-lmhead"))  # fmt: skip
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows per decode step")
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from benchmarks.quantization import resolve_model
    from kvserve import LLM

    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, None)
    path = None if args.model == "builtin" else str(model.path)
    llms = {
        key: LLM(
            model=path,
            **{"dtype": "bfloat16", **SETTINGS[key]},
            kv_cache_memory=f"{128 * args.batch}MiB",
            warmup=False,
        )
        for key in args.settings
    }
    # distinct first tokens: no row shares another's cached prefix
    prompt = [{"prompt_token_ids": [100 + i, *range(101, 228)]} for i in range(args.batch)]
    for llm in llms.values():
        step_ms(llm, prompt, 4)  # first-use costs (oneDNN kernels, heap) before timing
    times: dict[str, list[float]] = {k: [] for k in args.settings}
    for rep in range(args.repeats):
        order = args.settings if rep % 2 == 0 else args.settings[::-1]
        for key in order:
            times[key].append(step_ms(llms[key], prompt, args.tokens))
        print(f"rep {rep}: " + ", ".join(f"{k} {times[k][-1]:.2f}" for k in args.settings))
    summary = summarize(times)
    print(markdown(summary))
    if args.out is not None:
        record = {
            "benchmark": "decode_ab", "date": datetime.date.today().isoformat(),
            "machine": machine_info(), "args": {**vars(args), "out": str(args.out)},
            "run_paths": {key: run_paths(llm) for key, llm in llms.items()},
            "times_ms": times, "summary": summary,
        }  # fmt: skip
        args.out.write_text(json.dumps(record, indent=1))
        print(f"Saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
