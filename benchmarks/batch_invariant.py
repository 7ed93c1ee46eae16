"""What batch-invariant mode (``--batch-invariant``) costs: output tokens per second of the
built-in model with the mode off and on, at concurrency 1 and 32, in float32 (this CPU's
``dtype=auto`` on AVX2-only machines) and bfloat16.

    python -m benchmarks.batch_invariant                      # defaults below
    python -m benchmarks.batch_invariant --tokens 16 --repeats 1 --dtypes float32

Each (dtype, mode) is one ``LLM``; each repeat submits ``c`` prompts of ``--prompt-len``
random tokens in one ``generate`` call (greedy, ``ignore_eos``) and counts ``c * --tokens``
output tokens over the call's wall time (prefill included: the mode changes prefill too). The
best repeat is kept. Results go to ``benchmarks/results/batch_invariant-<date>.json`` with the
machine (``lscpu`` model name) and the paths each engine took.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository only (see benchmarks/decode_ab.py)

from benchmarks.machine import machine_info  # noqa: E402


def measure(llm: Any, concurrency: int, prompt_len: int, tokens: int, repeats: int) -> float:
    """Best output tok/s of ``repeats`` runs of ``concurrency`` requests at once."""
    import torch

    from kvserve import SamplingParams

    vocab = int(llm.engine.hf_config.vocab_size)
    g = torch.Generator().manual_seed(concurrency)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(concurrency)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = max(best, concurrency * tokens / (time.perf_counter() - t0))
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from kvserve.engine.llm import LLM

    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    machine: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        for invariant in (False, True):
            blocks = max(levels) * (-(-(args.prompt_len + args.tokens) // 16) + 1)
            llm = LLM(dtype=dtype, batch_invariant=invariant, max_num_seqs=max(levels),
                      num_kv_blocks=blocks, block_size=16)  # fmt: skip
            machine = machine_info(llm)
            for c in levels:
                tps = measure(llm, c, args.prompt_len, args.tokens, args.repeats)
                rows.append({"dtype": dtype, "batch_invariant": invariant, "concurrency": c,
                             "output_tok_s": round(tps, 2)})  # fmt: skip
                print(f"{dtype:9s} batch_invariant={invariant!s:5s} c={c:3d}: {tps:8.1f} tok/s")
            del llm
            gc.collect()
    for r in rows:
        if r["batch_invariant"]:
            off = next(o for o in rows if not o["batch_invariant"] and o["dtype"] == r["dtype"]
                       and o["concurrency"] == r["concurrency"])  # fmt: skip
            r["vs_off"] = round(r["output_tok_s"] / off["output_tok_s"], 3)
    result = {"benchmark": "batch_invariant", "date": datetime.date.today().isoformat(),
              "settings": vars(args) | {"out": None}, "machine": machine, "rows": rows}  # fmt: skip
    out = args.out or REPO / "benchmarks" / "results" / f"batch_invariant-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
