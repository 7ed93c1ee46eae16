"""Beam search (width 4) against ``n = 4`` sampling: generated tokens per second and KV blocks.

Both runs give every prompt 4 sequences of ``--max-tokens`` tokens (``ignore_eos``), on one
``LLMEngine`` stepped by hand so that the peak of KV blocks in use is read after every step.
Beam search forks its beams on the prompt's blocks (shared, copy-on-write of the partial last
one); ``n = 4`` children share the prompt's full blocks through the prefix cache. The runs
alternate ``--repeats`` times (slow spells of a shared machine fall on both). Prints one
markdown table and writes it as JSON with ``--out``.

    python benchmarks/beam_search.py --repeats 2 --out benchmarks/results/beam_search.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from kvserve.beam_search import BeamSearchParams  # noqa: E402
from kvserve.engine.llm import LLM  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

WIDTH = 4


def run(engine: LLMEngine, kind: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """One run: seconds, generated tokens (every sequence's), peak KV blocks in use."""
    proc = engine.processor
    for i, ids in enumerate(prompts):
        if kind == "beam":
            params = BeamSearchParams(beam_width=WIDTH, max_tokens=max_tokens, ignore_eos=True)
            req = proc.validate_beam_search(ids, params)
        else:
            sp = SamplingParams(n=WIDTH, temperature=1.0, seed=i, max_tokens=max_tokens,
                                ignore_eos=True, detokenize=False)  # fmt: skip
            req = proc.validate(ids, sp)
        engine.add_validated(f"{kind}-{i}", req)
    peak, steps = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.kv.pool.num_used_blocks)
    seconds = time.perf_counter() - t0
    tokens = len(prompts) * WIDTH * max_tokens
    engine.reset_prefix_cache()  # the next run starts from nothing cached
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "peak_blocks": peak, "steps": steps}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, block_size=16, num_kv_blocks=1024)
    engine = llm.engine
    ids = engine.tokenizer.encode("The history of the printing press " * 64)
    prompts = [ids[i : i + args.prompt_len] for i in range(args.prompts)]  # distinct prompts
    runs: dict[str, list[dict]] = {"beam": [], "n4": []}
    for r in range(args.repeats):
        for kind in ("beam", "n4") if r % 2 == 0 else ("n4", "beam"):
            runs[kind].append(run(engine, kind, prompts, args.max_tokens))
    rows = {
        k: {
            "tok_s": statistics.median(x["tok_s"] for x in v),
            "peak_blocks": max(x["peak_blocks"] for x in v),
            "runs": v,
        }
        for k, v in runs.items()
    }
    head = f"{args.prompts} prompts x {args.prompt_len} tokens, 4 x {args.max_tokens} out each"
    print(f"| run ({head}) | generated tok/s (median) | peak KV blocks (16 tokens) |")
    print("|---|---|---|")
    for k, label in (("beam", "beam search, width 4"), ("n4", "n = 4 sampling")):
        print(f"| {label} | {rows[k]['tok_s']:.1f} | {rows[k]['peak_blocks']} |")
    if args.out is not None:
        settings = vars(args) | {"out": str(args.out)}
        args.out.write_text(json.dumps(
            {"rows": rows, "settings": settings, "machine": machine_info()}, indent=1
        ))  # fmt: skip


if __name__ == "__main__":
    main()
