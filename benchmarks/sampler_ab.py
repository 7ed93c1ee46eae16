"""The sampler of a git revision against the working tree's, interleaved (issue 35).

Both ``kvserve/sample`` packages are loaded in one process (the revision's is extracted with
``git show`` and its imports renamed), and each repeat times every case with the two in turn
(order swapped every other repeat), so both sides of a ratio see the same machine phase.
Seeded rows get fresh generators per call; the token ids of the two sides are compared.

    python benchmarks/sampler_ab.py --ref HEAD~1 --repeats 15
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.sampling_params import SamplingParams  # noqa: E402

FILES = (
    "__init__",
    "custom_processors",
    "logits_processors",
    "rejection",
    "sampler",
    "top_k_top_p",
)
VOCAB = 49152  # SmolLM2's


def load_ref(ref: str, into: Path) -> ModuleType:
    """``kvserve/sample`` at ``ref`` as the package ``kvs_ref``; returns its sampler module."""
    pkg = into / "kvs_ref"
    pkg.mkdir()
    for name in FILES:
        text = subprocess.run(
            ["git", "show", f"{ref}:kvserve/sample/{name}.py"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (pkg / f"{name}.py").write_text(text.replace("kvserve.sample.", "kvs_ref."))
    sys.path.insert(0, str(into))
    return importlib.import_module("kvs_ref.sampler")


CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top-p 0.9, top-k 50": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "top-p 0.95 seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 1},
    "penalties + logprobs 5": {
        "temperature": 0.0,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "logprobs": 5,
    },
}


def call(mod: ModuleType, logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    n = len(params)
    md = mod.SamplingMetadata(
        params=params,
        prompt_token_ids=[list(range(100))] * n,
        output_token_ids=[list(range(50, 80))] * n,
        generators=[
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
        ],
        min_tokens_stop_ids=[[0]] * n,
        default_generator=torch.Generator().manual_seed(0),
    )
    return list(mod.sample(logits, md).sampled_token_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="HEAD~1")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    new = importlib.import_module("kvserve.sample.sampler")
    with tempfile.TemporaryDirectory() as tmp:
        old = load_ref(args.ref, Path(tmp))
        print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads")
        for batch in [int(b) for b in args.batches.split(",")]:
            logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
            logits = logits.bfloat16()
            for case, kw in CASES.items():
                params = [SamplingParams(**kw) for _ in range(batch)]
                times: dict[str, list[float]] = {"ref": [], "new": []}
                same = call(old, logits, params) == call(new, logits, params)
                for r in range(args.repeats):
                    order = [("ref", old), ("new", new)][:: 1 if r % 2 else -1]
                    for side, mod in order:
                        start = time.perf_counter()
                        call(mod, logits, params)
                        times[side].append(time.perf_counter() - start)
                ref_ms = statistics.median(times["ref"]) * 1e3
                new_ms = statistics.median(times["new"]) * 1e3
                print(
                    f"batch {batch:3d} {case:26s} ref {ref_ms:8.3f} ms  new {new_ms:8.3f} ms"
                    f"  new/ref {new_ms / ref_ms:5.3f}  same tokens: {same}"
                )
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
