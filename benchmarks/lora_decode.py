"""What adapters cost a decode step (issue 32): base only on the C++ decode loop, base only
on the Python layers (``enforce_eager``), and 1 or 4 rank-16 adapters across the batch
(adapter steps take the Python layers plus the grouped LoRA matmuls). All in one process,
interleaved per repeat as ``decode_ab.py`` does (the 2-core machines' bandwidth drifts).

    python -m benchmarks.lora_decode --batch 8 --tokens 48 --repeats 5  # (-m: benchmarks/kernels.py
    # would shadow the kernels package transformers probes for)

Adapters are made with peft (random A and B, rank 16, q/k/v/o/gate/up/down) in a temporary
folder over the built-in model. Prints decode tok/s per setting and the ratios to the base.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model.builtin import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def decode_tps(llm: LLM, prompts: list[list[int]], loras: list, tokens: int) -> float:
    """Decode tokens per second: (t(1 + n) - t(1)) over the batch's n extra tokens each."""

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                     lora_request=loras)  # fmt: skip
        return time.perf_counter() - t0

    llm.reset_prefix_cache()
    one = run(1)
    llm.reset_prefix_cache()
    return len(prompts) * tokens / (run(1 + tokens) - one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (num_threads)")
    args = ap.parse_args()
    base, _ = resolve_model(None)
    tmp = Path(tempfile.mkdtemp())
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_adapter(base, tmp / f"a{i}", i)))
                for i in range(4)]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (32,), generator=g).tolist() for _ in range(args.batch)]
    kw = {"num_threads": args.threads, "num_kv_blocks": 256, "warmup": False}
    lora = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, **kw)
    eager = LLM(str(base), enforce_eager=True, **kw)
    settings = {
        "base (C++ loop)": (lora, [None] * args.batch),
        "base (Python layers)": (eager, [None] * args.batch),
        "1 adapter": (lora, [adapters[0]] * args.batch),
        "4 adapters": (lora, [adapters[i % 4] for i in range(args.batch)]),
    }
    results: dict[str, list[float]] = {k: [] for k in settings}
    for rep in range(args.repeats):
        order = list(settings) if rep % 2 == 0 else list(reversed(settings))
        for name in order:
            llm, loras = settings[name]
            results[name].append(decode_tps(llm, prompts, loras, args.tokens))
            print(f"repeat {rep}: {name}: {results[name][-1]:.1f} tok/s", flush=True)
    base_tps = statistics.median(results["base (C++ loop)"])
    print(f"batch {args.batch}, {args.tokens} decode tokens, median of {args.repeats}:")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:22s} {med:8.1f} tok/s  x{med / base_tps:.2f}")


if __name__ == "__main__":
    main()
