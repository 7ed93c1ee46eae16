"""What adapters cost a decode step (issue 32): the base model alone, then 1, 4, 16 ...
distinct rank-16 adapters spread over the batch (``--adapters``), all on the C++ decode loop
with the C++ LoRA kernel (``csrc/lora_ops.cpp``) where it is built; ``--with-eager`` adds the
base model on the Python layers (``enforce_eager``). All in one process, interleaved per repeat
as ``decode_ab.py`` does (the 2-core machines' bandwidth drifts).

    python -m benchmarks.lora_decode --batch 32 --adapters 0,1,4,16 --tokens 32 --repeats 3
    # (-m: benchmarks/kernels.py would shadow the kernels package transformers probes for)

Adapters are made with peft (random A and B, rank 16, q/k/v/o/gate/up/down) in a temporary
folder over the built-in model. Prints decode tok/s per setting and the ratios to the base.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model.builtin import resolve_model

_IDS = itertools.count()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def decode_tps(llm: LLM, prompts: list[list[int]], loras: list, tokens: int) -> float:
    """Decode tokens per second of the batch's decode-only steps: the engine is stepped by
    hand, the clock starts once every request has its first token (the prefill, ~30x a
    decode step's work at batch 32, stays out of the figure) and stops when all are done."""
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    llm.reset_prefix_cache()
    ids = [f"r{next(_IDS)}" for _ in prompts]
    for rid, p, lr in zip(ids, prompts, loras, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp, lora_request=lr)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * tokens / (time.perf_counter() - t0)


def loop_ab(
    llm: LLM, adapters: list[LoRARequest], counts: list[int], batch: int, reps: int
) -> None:
    """The C++ decode loop's layers alone (no embedding, LM head nor sampling), called on one
    fixed decode batch (32 tokens of context per row) with each setting's per-row slots,
    the settings alternating call by call: the cleanest A/B a loaded machine allows."""
    runner = llm.engine.runner
    model, lora = runner.model, runner.lora  # type: ignore[union-attr]
    loop = model.decode_loop
    attn = model.layers[0].self_attn
    bs = runner.block_size
    ctx = 32
    nb = (ctx + bs) // bs
    g = torch.Generator().manual_seed(1)
    ks, vs = [k for k, _ in runner.kv_caches], [v for _, v in runner.kv_caches]
    dtype = ks[0].dtype  # the model's activations' (bf16 where that is the default)
    x = (torch.randn(batch, model.config.hidden_size, generator=g) * 0.1).to(dtype)  # [B, hidden]
    cos = torch.ones(batch, attn.head_dim, dtype=dtype)  # [B, D]
    sin = torch.zeros(batch, attn.head_dim, dtype=dtype)
    tables = torch.arange(batch * nb).view(batch, nb)  # [B, nb] distinct blocks per row
    seq_lens = torch.full((batch,), ctx + 1, dtype=torch.long)
    slot_mapping = tables[:, ctx // bs] * bs + ctx % bs  # [B] the new token's cache slot
    slots: dict[str, torch.Tensor | None] = {}
    for c in counts:
        if c == 0:
            slots["base"] = None
            continue
        m = lora.prepare([adapters[i % c] for i in range(batch)], [1] * batch)
        slots[f"{c} adapter{'s' * (c > 1)}"] = m.token_slots
    times: dict[str, list[float]] = {k: [] for k in slots}
    for _ in range(reps):
        for name, s in slots.items():
            t0 = time.perf_counter()
            loop.layers.run(x, cos, sin, slot_mapping, tables, seq_lens, ks, vs, s, None)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[next(iter(times))])
    print(f"decode loop layers, batch {batch}, median of {reps} alternating calls:")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {med * 1e3:8.2f} ms  x{med / base:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (num_threads)")
    ap.add_argument(
        "--adapters",
        default="0,1,4",
        help="distinct adapters per setting, comma-separated (0: the base alone)",
    )
    ap.add_argument(
        "--with-eager",
        action="store_true",
        help="also the base model on the Python layers (enforce_eager)",
    )
    ap.add_argument(
        "--loop-ab",
        type=int,
        default=0,
        metavar="REPS",
        help="instead: time the C++ decode loop's layers alone, REPS alternating calls per setting",
    )
    args = ap.parse_args()
    counts = sorted({int(c) for c in args.adapters.split(",")})
    base, _ = resolve_model(None)
    tmp = Path(tempfile.mkdtemp())
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_adapter(base, tmp / f"a{i}", i)))
                for i in range(max(counts))]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (32,), generator=g).tolist() for _ in range(args.batch)]
    blocks = args.batch * ((32 + args.tokens + 2) // 16 + 2)
    kw = {"num_threads": args.threads, "num_kv_blocks": blocks, "warmup": False}
    lora = LLM(str(base), enable_lora=True, max_loras=max(1, max(counts)), max_lora_rank=16,
               **kw)  # fmt: skip
    loop = lora.engine.runner.model.decode_loop  # type: ignore[union-attr]
    print(f"C++ decode loop: {loop is not None}, LoRA on it: {bool(loop and loop.has_lora)}")
    if args.loop_ab:
        loop_ab(lora, adapters, counts, args.batch, args.loop_ab)
        return
    settings: dict[str, tuple[LLM, list]] = {}
    for c in counts:
        name = "base" if c == 0 else f"{c} adapter{'s' * (c > 1)}"
        settings[name] = (lora, [adapters[i % c] if c else None for i in range(args.batch)])
    if args.with_eager:
        eager = LLM(str(base), enforce_eager=True, **kw)
        settings["base (Python layers)"] = (eager, [None] * args.batch)
    results: dict[str, list[float]] = {k: [] for k in settings}
    for rep in range(args.repeats):
        order = list(settings) if rep % 2 == 0 else list(reversed(settings))
        for name in order:
            llm, loras = settings[name]
            results[name].append(decode_tps(llm, prompts, loras, args.tokens))
            print(f"repeat {rep}: {name}: {results[name][-1]:.1f} tok/s", flush=True)
    base_tps = statistics.median(results[next(iter(settings))])
    print(f"batch {args.batch}, {args.tokens} decode tokens, median of {args.repeats}:")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:22s} {med:8.1f} tok/s  x{med / base_tps:.2f}")


if __name__ == "__main__":
    main()
