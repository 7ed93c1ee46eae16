"""Decode-step kernels, fast path vs the PyTorch path they replace, on the 160M model's shapes.

For each batch size: decode attention (C++ kernel vs gather + SDPA) over ``--context`` tokens
per row with 8 layers' caches visited in turn and 32 MB of "weights" read between layers (so
K/V come from memory, as in a real step, not from a warm cache), and the fused elementwise
ops (RMSNorm, SiLU*up, RoPE + KV write, greedy argmax) vs their op chains. Prints ms per call.

    python benchmarks/kernels.py --batch 1,8,64,128 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.paged import AttentionMetadata, write_kv
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.model.llama import RMSNorm, apply_rope
from kvserve.ops import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS = 16, 8, 64, 1024, 2816, 32000, 8
DT = torch.bfloat16


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def attention_ms(batch: int, context: int, block_size: int, use_kernel: bool) -> float:
    """Mean ms per layer of decode attention, cycling through LAYERS caches."""
    g = torch.Generator().manual_seed(0)
    nb = -(-context // block_size)
    num_blocks = batch * nb * 2
    caches = [
        (
            torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=g).to(DT),
            torch.randn(num_blocks, KV_HEADS, block_size, HEAD_DIM, generator=g).to(DT),
        )
        for _ in range(LAYERS)
    ]
    weights = [torch.randn(16 * 2**20, generator=g).to(DT) for _ in range(LAYERS)]
    # Blocks handed out round-robin across requests, as a FIFO free list does under load.
    tables = (torch.arange(nb)[None, :] * batch + torch.arange(batch)[:, None]).contiguous()
    md = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long),
        query_start_loc=list(range(batch + 1)),
        seq_lens=[context] * batch,
        block_tables=tables,
        block_size=block_size,
    )
    cls = CpuKernelBackend if use_kernel else TorchSDPABackend
    backend = cls(torch.device("cpu"))
    md = backend.build_metadata(md)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(DT)
    total, calls = 0.0, 0
    for rnd in range(4):
        for layer in range(LAYERS):
            weights[layer].sum()  # evict: what the layer's linears do to the caches
            t0 = time.perf_counter()
            backend.forward(q, *caches[layer], md, HEAD_DIM**-0.5)
            if rnd > 0:
                total += time.perf_counter() - t0
                calls += 1
    return total / calls * 1e3


def fused_ms(batch: int, repeats: int) -> dict[str, tuple[float, float]]:
    """(fused, op chain) ms per call of each fused op at ``batch`` tokens."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, HIDDEN, generator=g).to(DT)
    norm = RMSNorm(HIDDEN, 1e-5).to(DT)
    gate_up = torch.randn(batch, 2 * INTER, generator=g).to(DT)
    gate, up = gate_up.split(INTER, dim=-1)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(DT)
    cos = torch.rand(batch, HEAD_DIM, generator=g).to(DT)
    sin = torch.rand(batch, HEAD_DIM, generator=g).to(DT)
    k_cache = torch.zeros(batch, KV_HEADS, 1, HEAD_DIM, dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(batch)
    logits = torch.randn(batch, VOCAB, generator=g).to(DT)
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]

    def rope_chain() -> None:
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = apply_rope(
            (cos.unsqueeze(1), sin.unsqueeze(1)),
            q.view(batch, HEADS, HEAD_DIM),
            k.view(batch, KV_HEADS, HEAD_DIM),
        )
        write_kv(k, v.view(batch, KV_HEADS, HEAD_DIM), k_cache, v_cache, slots)

    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "rms_norm": (lambda: cpu_kernels.rms_norm(x, norm.weight, 1e-5), lambda: norm(x)),
        "silu_and_mul": (
            lambda: cpu_kernels.silu_and_mul(gate_up),
            lambda: torch.nn.functional.silu(gate) * up,
        ),
        "rope_write_kv": (
            lambda: cpu_kernels.rope_write_kv(
                qkv, cos, sin, k_cache, v_cache, slots, HEADS, KV_HEADS
            ),
            rope_chain,
        ),
        "greedy argmax": (
            lambda: cpu_kernels.argmax_rows(logits),
            lambda: logits.float().max(dim=-1).indices,
        ),
    }
    with torch.inference_mode():
        return {
            name: (timed(fast, repeats) * 1e3, timed(ref, repeats) * 1e3)
            for name, (fast, ref) in pairs.items()
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,64,128", help="decode rows per step")
    ap.add_argument("--context", type=int, default=96, help="tokens of context per row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the C++ CPU kernels did not build; nothing to compare")
    batches = [int(b) for b in args.batch.split(",")]
    print(f"threads {args.threads}, context {args.context}, bf16, ms per call (per layer)\n")
    print("| op | batch | C++ kernel | PyTorch path | speed-up |")
    print("|---|---|---|---|---|")
    for b in batches:
        fast = attention_ms(b, args.context, args.block_size, use_kernel=True)
        ref = attention_ms(b, args.context, args.block_size, use_kernel=False)
        print(f"| decode attention | {b} | {fast:.3f} | {ref:.3f} | {ref / fast:.1f}x |")
    for b in batches:
        for name, (fast, ref) in fused_ms(b, args.repeats).items():
            print(f"| {name} | {b} | {fast:.3f} | {ref:.3f} | {ref / fast:.1f}x |")


if __name__ == "__main__":
    main()
