"""Prefill attention per query token: fresh prompts vs rows after cached context.

On the 160M model's attention shape (16 heads, 8 KV heads, head_dim 64, block size 16), one
layer's ``paged_attention`` call (metadata built once, as the runner does per step) for
  (a) fresh:   n fresh prompts of ``--lq`` tokens, and of ``--ctx + --lq`` tokens (one
               ``PrefillGroup`` SDPA call each),
  (b) loop:    n rows of ``--lq`` new tokens after ``--ctx`` cached ones, per-row reference loop,
  (c) batched: the same rows through the padded ``ContextGroup`` path,
  (d) mixed:   n rows of random context (0..2 * ctx) and query (16..2 * lq) lengths, loop vs
               batched (the bucketing at work).
Prints the median ms per call over ``--repeats`` calls (loop and batched calls alternate), us
per query token and ns per attended query-key pair (all heads); blocks are handed out
shuffled, as after a while of serving. On a shared machine ``--threads 1 --clock cpu`` counts
only this thread's CPU time, not the time it waited for a core.

    python benchmarks/prefill_attention.py --rows 8,32 --dtype bf16,fp32 --threads 2
    python benchmarks/prefill_attention.py --threads 1 --clock cpu --repeats 9
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Callable

import torch

from kvserve.attention.paged import AttentionMetadata, GatherWorkspace, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_step(
    ctx_lens: list[int], q_lens: list[int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Caches holding every row's context (shuffled blocks), the queries, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    nbs = [-(-s // BLOCK) for s in seq_lens]
    perm = torch.randperm(sum(nbs), generator=g).tolist()
    tables, slots, qsl = [], [], [0]
    for s, n, nb in zip(seq_lens, q_lens, nbs, strict=True):
        blocks, perm = perm[:nb], perm[nb:]
        tables.append(blocks + [0] * (max(nbs) - nb))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - n, s)]
        qsl.append(qsl[-1] + n)
    shape = (sum(nbs), KV_HEADS, BLOCK, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)  # [num_blocks, Hkv, bs, D]
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, generator=g).to(dtype)  # [T, H, D]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=torch.tensor(tables),
        block_size=BLOCK,
    )
    return q, k_cache, v_cache, md


def run(
    ctx_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype,
    modes: list[bool],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[float, float, float, int]]:
    """Per mode (batch_context or not), on one step, the modes' calls interleaved (the other
    engineers' load drifts; alternating keeps it even): (median ms per call, us per query
    token, ns per attended query-key pair, SDPA calls per layer)."""
    q, k_cache, v_cache, md = make_step(ctx_lens, q_lens, dtype, seed=0)
    mds = [dataclasses.replace(md) for _ in modes]
    for m, batch in zip(mds, modes, strict=True):
        m.split_rows(GatherWorkspace(), batch_context=batch)
    times: list[list[float]] = [[] for _ in modes]
    with torch.inference_mode():
        for i in range(repeats + 2):  # two warm-up rounds: buffers grow, masks get built
            for m, ts in zip(mds, times, strict=True):
                t0 = clock()
                paged_attention(q, k_cache, v_cache, m, HEAD_DIM**-0.5)
                if i >= 2:
                    ts.append(clock() - t0)
    tokens = sum(q_lens)
    # Query i of a row sees keys 0..ctx + i: ctx + i + 1 of them.
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(ctx_lens, q_lens, strict=True))
    results = []
    for m, ts in zip(mds, times, strict=True):
        ms = sorted(ts)[len(ts) // 2] * 1e3
        calls = len(m.prefill_groups) + len(m.context_groups) + len(m.prefill_rows or [])
        results.append((ms, ms * 1e3 / tokens, ms * 1e6 / pairs, calls))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,32", help="prefill rows per step")
    ap.add_argument("--ctx", type=int, default=1000, help="cached tokens before the new ones")
    ap.add_argument("--lq", type=int, default=100, help="new (query) tokens per row")
    ap.add_argument("--dtype", default="bf16,fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time (needs --threads 1); steadier on a shared machine, "
        "where time waiting for a core would count as the call's",
    )
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts only this thread: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, {args.clock} clock, H {HEADS}, Hkv {KV_HEADS}, D {HEAD_DIM}")
    print("| dtype | rows | case | calls | ms/call | us/query token | ns/query-key pair |")
    print("|---|---|---|---|---|---|---|")
    rnd = random.Random(0)
    for name in args.dtype.split(","):
        dtype = DTYPES[name]
        for n in (int(r) for r in args.rows.split(",")):
            full, after = args.ctx + args.lq, f"{args.lq} after {args.ctx}"
            rand_ctx = [rnd.randrange(0, 2 * args.ctx) for _ in range(n)]
            rand_q = [rnd.randrange(16, 2 * args.lq) for _ in range(n)]
            cases = [
                ([f"(a) fresh L={args.lq}"], [0] * n, [args.lq] * n),
                ([f"(a) fresh L={full}"], [0] * n, [full] * n),
                ([f"(b) loop {after}", f"(c) batched {after}"], [args.ctx] * n, [args.lq] * n),
                (["(d) loop, random sizes", "(d) batched, random sizes"], rand_ctx, rand_q),
            ]
            for labels, ctx, ql in cases:
                modes = [True] if len(labels) == 1 else [False, True]
                for label, res in zip(
                    labels, run(ctx, ql, dtype, modes, args.repeats, clock), strict=True
                ):
                    ms, us_tok, ns_pair, calls = res
                    row = f"| {name} | {n} | {label} | {calls} | {ms:.2f} | {us_tok:.2f} |"
                    print(f"{row} {ns_pair:.1f} |", flush=True)


if __name__ == "__main__":
    main()
