"""How close is a kvserve decode step to this machine's limit?

Measures the machine's memory read bandwidth and best bf16 matmul rate, then for a model and
batch sizes prints the floor time of one decode step —
  memory floor  = (weight bytes + KV bytes read) / bandwidth
  compute floor = FLOPs / matmul rate
— beside kvserve's measured decode step (mean over steady-state steps, from the engine's own
step-time breakdown).

    python benchmarks/roofline.py                       # the 160M random Llama of issue 5
    python benchmarks/roofline.py --model builtin       # the built-in SmolLM2-135M
    python benchmarks/roofline.py --batch-sizes 1,8,64,128 --context 160
    python benchmarks/roofline.py --model builtin --quantization int4   # 4.5 bits a weight

With ``--quantization`` the decoder layers' weights count the bytes of their codes and scales
(the engine's own ``QuantReport``), the LM head its model-dtype bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from int8_peak import int8_peak_isa, measure_int8_peak
from peers.run_peers import make_model  # the 160M random Llama of the peer table

from kvserve import LLM, SamplingParams
from kvserve.config import auto_dtype
from kvserve.model.loader import load_hf_config


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (sum over a large buffer), best of ``repeats``."""
    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def measure_matmul(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a square matmul in ``dtype``, best of ``repeats``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def step_floor(
    cfg: object,
    batch: int,
    context: int,
    bw: float,
    flops: float,
    elem: int = 2,
    layer_bytes: int | None = None,
) -> tuple[float, float, int]:
    """(memory floor s, compute floor s, weight bytes) of one decode step. ``layer_bytes``:
    the decoder layers' linear weights as stored (quantized), else ``elem`` bytes each."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * (heads * d + 2 * kv_heads * d) + heads * d * h + 3 * h * inter
    linear_params = layers * per_layer + h * cfg.vocab_size  # + lm_head
    if layer_bytes is None:
        layer_bytes = layers * per_layer * elem
    weight_bytes = layer_bytes + h * cfg.vocab_size * elem
    kv_bytes = batch * context * 2 * layers * kv_heads * d * elem
    attn_flops = 4 * batch * context * heads * d * layers
    mem = (weight_bytes + kv_bytes) / bw
    comp = (2 * batch * linear_params + attn_flops) / flops
    return mem, comp, weight_bytes


def measured_step(
    model: str | None,
    batch: int,
    context: int,
    dtype: str,
    steps: int = 24,
    quantization: str | None = None,
) -> tuple[float, int | None]:
    """Mean seconds per decode step with ``batch`` requests at about ``context`` tokens, and
    the bytes of the quantized layers (None: not quantized)."""
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, kv_cache_memory="2GiB",
              quantization=quantization)  # fmt: skip
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(context)]}
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    eng = llm.engine
    for i in range(batch):
        eng.add_request(f"r{i}", prompt, params)
    # Prefill (chunked by max_num_batched_tokens) plus two warm-up decode steps, so only
    # decode steps are timed.
    while any(r.num_output_tokens < 2 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    elapsed = (time.perf_counter() - t0) / steps
    eng.abort_request([f"r{i}" for i in range(batch)])
    report = getattr(eng.runner.model, "quant_report", None)
    return elapsed, None if report is None else report.weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random-160m", help="random-160m, builtin, or a folder")
    ap.add_argument("--batch-sizes", default="1,8,64,128")
    ap.add_argument("--context", type=int, default=160, help="tokens per request at decode")
    ap.add_argument(
        "--dtype", default="auto", choices=("bfloat16", "float32", "auto"),
        help="weights and matmuls; auto (default): what kvserve picks here (float32 on "
        "AVX2-only CPUs, where bf16 is emulated and a 2048^2 bf16 matmul takes seconds, "
        "which made the bf16 default print a 0.00 TFLOP/s ceiling there)",
    )  # fmt: skip
    ap.add_argument(
        "--quantization",
        choices=("int8", "int4", "gguf"),
        default=None,
        help="weight-only quantized layers (gguf: the built-in model's Q4_1)",
    )
    args = ap.parse_args()
    dtype = auto_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    name = str(dtype).removeprefix("torch.")
    bw, mm = measure_bandwidth(), measure_matmul(dtype=dtype)
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s; {name} matmul {mm / 1e12:.2f} TFLOP/s")
    isa = int8_peak_isa()
    if args.quantization and isa:  # the int8-activation kernel's ceiling
        print(f"int8 dot-product peak ({isa}) {measure_int8_peak() / 1e12:.2f} T ops/s")
    with tempfile.TemporaryDirectory() as tmp:
        model: str | None = None if args.model == "builtin" else args.model
        if args.model == "random-160m":
            model = tmp
            make_model(Path(tmp))
        from kvserve.model.builtin import resolve_model

        cfg = load_hf_config(resolve_model(model)[0])
        print(
            "| batch | memory floor ms | compute floor ms | floor ms | kvserve step ms | "
            "floor / measured |"
        )
        print("|---|---|---|---|---|---|")
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            elem = torch.empty((), dtype=dtype).element_size()
            step, qbytes = measured_step(model, b, args.context, name,
                                         quantization=args.quantization)  # fmt: skip
            mem, comp, _ = step_floor(cfg, b, args.context, bw, mm, elem, qbytes)
            floor = max(mem, comp)
            print(
                f"| {b} | {mem * 1e3:.1f} | {comp * 1e3:.1f} | {floor * 1e3:.1f} | "
                f"{step * 1e3:.1f} | {floor / step:.0%} |"
            )


if __name__ == "__main__":
    main()
