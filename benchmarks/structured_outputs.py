"""What does a JSON-schema grammar cost? Output tokens/s with and without it, offline.

The built-in SmolLM2-135M-Instruct runs through ``kvserve.LLM`` at concurrency 1 (one request
at a time) and 32 (``max_num_seqs=32``, more requests than that queued, so 32 decode together),
each sampled at temperature 0.8 with a per-request seed:

* **with**: ``StructuredOutputsParams(json=SCHEMA)``; the request ends when the grammar does;
* **without**: the same prompts and seeds, no grammar, ``ignore_eos`` and ``max_tokens`` equal
  to the length the same request had in the preceding *with* run (``ignore_eos`` cannot be
  used with a grammar, so the grammar's own lengths set both), so both do the same decode work.

Throughput = the output tokens actually produced (sum of ``len(token_ids)``) / wall time. The
runs alternate (with, without, with, without, ...) ``--repeats`` times and the median counts,
so slow spells of a shared machine fall on both. Each run also records the engine's per-step
time split (``llm.stats()["step_time"]``: schedule / prepare / forward / sample / output, as
deltas over the run): the grammar's bitmask is filled in ``Scheduler.schedule`` and applied in
the sampler, so those two phases show its cost. Targets (issue 13): the grammar costs at most
15% of the tokens/s at concurrency 1 and at most 10% at 32.

Prints a markdown table and writes ``benchmarks/results/structured_outputs-<date>.json``
(every run, medians, targets, settings, machine).

    python benchmarks/structured_outputs.py                        # the measurement
    python benchmarks/structured_outputs.py --c1-requests 2 --c32-requests 32 --repeats 1 \\
        --max-tokens 96 --out /tmp/so.json                         # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info as shared_machine_info  # noqa: E402
from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "output")
TARGETS = {1: 0.15, 32: 0.10}  # most tokens/s the grammar may cost, by concurrency
MODES = ("with", "without")


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


# A typical extraction schema: nested object, enum, bounded integers, an array of objects.
# Strings are bounded so outputs end inside --max-tokens (70-130 tokens, pretty-printed).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": _str(24),
        "email": _str(32),
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tier": {"enum": ["free", "pro", "enterprise"]},
        "address": {
            "type": "object",
            "properties": {"city": _str(16), "country": _str(16)},
            "required": ["city", "country"],
        },
        "orders": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": _str(10),
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "quantity"],
            },
        },
    },
    "required": ["name", "email", "age", "tier", "address", "orders"],
}
NAMES = ["Ada", "Bo", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi",
         "Lena", "Mateo", "Nia", "Omar", "Priya"]  # fmt: skip


def prompts(n: int) -> list[str]:
    return [f"Customer {i + 1} ({NAMES[i % len(NAMES)]}) as a JSON record:" for i in range(n)]


def run(
    llm: LLM, texts: list[str], params: list[SamplingParams], concurrency: int
) -> dict[str, Any]:
    """Generate ``texts`` at ``concurrency`` (1: one request at a time; else one batch, the
    engine's ``max_num_seqs`` bounding what decodes together); wall time, tokens, step split."""
    before = llm.stats()["step_time"]
    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [
            llm.generate([t], [p], use_tqdm=False)[0] for t, p in zip(texts, params, strict=True)
        ]
    else:
        outs = llm.generate(texts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.stats()["step_time"]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += o.outputs[0].finish_reason == "stop"
        except json.JSONDecodeError:
            pass
    split = {k: after[k] - before[k] for k in (*PHASES, "steps")}
    return {
        "wall_s": wall,
        "output_tokens": sum(lengths),
        "tok_per_s": sum(lengths) / wall,
        "lengths": lengths,
        "valid_json_stop": valid,
        "step_time_s": split,
    }


def measure(llm: LLM, args: argparse.Namespace, concurrency: int) -> list[dict[str, Any]]:
    n = args.c1_requests if concurrency == 1 else args.c32_requests
    texts = prompts(n)
    schema = StructuredOutputsParams(json=SCHEMA)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        seeds = [10_000 * repeat + i for i in range(n)]
        with_params = [
            SamplingParams(temperature=0.8, seed=s, max_tokens=args.max_tokens,
                           structured_outputs=schema)
            for s in seeds
        ]  # fmt: skip
        r = run(llm, texts, with_params, concurrency)
        runs.append({"concurrency": concurrency, "repeat": repeat, "mode": "with", **r})
        report(runs[-1])
        without_params = [
            SamplingParams(temperature=0.8, seed=s, max_tokens=max(1, length), ignore_eos=True)
            for s, length in zip(seeds, r["lengths"], strict=True)
        ]
        r = run(llm, texts, without_params, concurrency)
        runs.append({"concurrency": concurrency, "repeat": repeat, "mode": "without", **r})
        report(runs[-1])
    return runs


def report(r: dict[str, Any]) -> None:
    print(
        f"  c={r['concurrency']:<2} repeat {r['repeat']} {r['mode']:<7}: "
        f"{r['output_tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_per_s']:.1f} tok/s "
        f"({r['valid_json_stop']}/{len(r['lengths'])} valid JSON)",
        flush=True,
    )


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in sorted({r["concurrency"] for r in runs}):
        entry: dict[str, Any] = {}
        for mode in MODES:
            mine = [r for r in runs if r["concurrency"] == c and r["mode"] == mode]
            per_step = {}
            for k in PHASES:
                values = [r["step_time_s"][k] / max(1, r["step_time_s"]["steps"]) for r in mine]
                per_step[k] = statistics.median(values) * 1e3
            entry[mode] = {
                "tok_per_s_median": statistics.median(r["tok_per_s"] for r in mine),
                "tok_per_s_runs": [r["tok_per_s"] for r in mine],
                "output_tokens_median": statistics.median(r["output_tokens"] for r in mine),
                "steps_median": statistics.median(r["step_time_s"]["steps"] for r in mine),
                "ms_per_step_median": per_step,
            }
        cost = 1 - entry["with"]["tok_per_s_median"] / entry["without"]["tok_per_s_median"]
        entry["grammar_cost"] = cost
        entry["target_max_cost"] = TARGETS.get(c)
        entry["meets_target"] = c in TARGETS and cost <= TARGETS[c]
        out[str(c)] = entry
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| concurrency | tok/s without | tok/s with JSON schema | grammar cost | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for c, e in summary.items():
        target = e["target_max_cost"]
        lines.append(
            f"| {c} | {e['without']['tok_per_s_median']:.1f} | {e['with']['tok_per_s_median']:.1f}"
            f" | {e['grammar_cost']:+.1%} | {'≤ ' + format(target, '.0%') if target else '-'}"
            f" | {'yes' if e['meets_target'] else 'no'} |"
        )
    lines += [
        "",
        "Median ms per engine step (``llm.stats()['step_time']``):",
        "",
        "| concurrency | mode | steps | " + " | ".join(PHASES) + " | total |",
        "|---|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    for c, e in summary.items():
        for mode in MODES:
            ms = e[mode]["ms_per_step_median"]
            cells = " | ".join(f"{ms[k]:.2f}" for k in PHASES)
            lines.append(
                f"| {c} | {mode} | {e[mode]['steps_median']:.0f} | {cells} | "
                f"{sum(ms.values()):.2f} |"
            )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """The shared record (``machine.py``) plus xgrammar's version."""
    from importlib.metadata import PackageNotFoundError, version

    info = shared_machine_info()
    try:
        info["xgrammar"] = version("xgrammar")
    except PackageNotFoundError:
        info["xgrammar"] = None
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--c1-requests", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--c32-requests", type=int, default=64, help="requests at concurrency 32")
    ap.add_argument("--repeats", type=int, default=3, help="alternating with/without pairs")
    ap.add_argument("--max-tokens", type=int, default=256, help="cap of the grammar runs")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    out = Path(args.out or REPO / "benchmarks" / "results" / f"structured_outputs-{date}.json")

    llm = LLM(None, dtype=args.dtype, max_num_seqs=32, num_threads=args.num_threads)
    # Warm-up: the model, the sampler's paths, the tokenizer info and this schema's grammar.
    t0 = time.perf_counter()
    schema = StructuredOutputsParams(json=SCHEMA)
    llm.generate(prompts(2), SamplingParams(temperature=0.8, seed=0, max_tokens=24,
                                            structured_outputs=schema), use_tqdm=False)  # fmt: skip
    llm.generate(prompts(2), SamplingParams(temperature=0.8, seed=0, max_tokens=8,
                                            ignore_eos=True), use_tqdm=False)  # fmt: skip
    print(f"warm-up (incl. tokenizer info and grammar compile): {time.perf_counter() - t0:.1f} s")

    runs: list[dict[str, Any]] = []
    for c in (1, 32):
        print(f"concurrency {c}:", flush=True)
        runs += measure(llm, args, c)
    summary = summarize(runs)
    table = markdown(summary)
    print()
    print(table)
    doc = {
        "benchmark": "structured_outputs",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": "builtin (SmolLM2-135M-Instruct)",
        "schema": SCHEMA,
        "settings": vars(args),
        "targets_max_cost": {str(k): v for k, v in TARGETS.items()},
        "summary": summary,
        "runs": runs,
        "machine": machine_info(),
        "markdown": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nSaved {out}")


if __name__ == "__main__":
    main()
