"""The Triton attention kernels on a CUDA GPU: correctness against the reference, then timing.

1. ``triton_paged_attention`` against ``reference_paged_attention`` on the GPU in float32,
   float16 and bfloat16 (bfloat16 cannot be checked in Triton's interpreter,
   triton-lang/triton#11584): a mixed batch (decode, split-K decode, fresh prompt, chunk after
   cached context, verification rows) with Llama-3.2-1B's heads (32 query, 8 KV, head_dim 64),
   plain, with a sliding window and with a soft-cap. Prints and records the largest error.
2. One layer's decode attention at batch 1 and 64 (context ``--context`` each, bf16, 16-token
   blocks scattered over the cache): the Triton kernel against today's CUDA path
   (``paged_attention``: gather + masked SDPA), with CUDA events, beside the floor of reading
   that K/V once at the bandwidth a device-to-device copy measures here.
3. One layer's prefill attention for 8 prompts of 512 tokens after 512 cached tokens each.

Writes one JSON (``--out``). Not a test: nothing here asserts a speed.

    python benchmarks/gpu/check.py --out benchmarks/results/gpu_kernels.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402

from kvserve.model.attention import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    reference_paged_attention,
)
from kvserve.ops.triton.paged_attention import triton_paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16  # Llama-3.2-1B
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}  # tests/ops' tolerances


def make_batch(
    lens: list[int], qlens: list[int], dtype: torch.dtype, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q ``[T, H, D]``, caches ``[NB, Hkv, BS, D]`` on the GPU and metadata; each row's blocks
    are scattered over a cache twice the needed size."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    nb = 2 * sum(need) + 1
    pool = torch.randperm(nb, device="cuda", generator=g).tolist()
    tables = []
    for m in need:
        tables.append(pool[:m] + [0] * (max(need) - m))
        pool = pool[m:]
    shape = (nb, KV_HEADS, BLOCK, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=g).to(dtype)
    v = torch.randn(shape, device="cuda", generator=g).to(dtype)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, device="cuda", generator=g).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device="cuda"),
        query_start_loc=qsl,
        seq_lens=list(lens),
        block_tables=torch.tensor(tables, dtype=torch.long, device="cuda"),
        block_size=BLOCK,
    )
    return q, k, v, md


def check_correctness() -> list[dict[str, Any]]:
    results = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for opts in ({}, {"sliding_window": 100}, {"soft_cap": 1.0}):
            q, k, v, md = make_batch([1, 700, 1500, 64, 900, 300], [1, 1, 1, 64, 200, 4], dtype)
            md.spec_rows = frozenset({5})
            scale = HEAD_DIM**-0.5
            want = reference_paged_attention(q, k, v, md, scale, **opts)
            got = triton_paged_attention(q, k, v, md, scale, **opts)
            err = (got.float() - want.float()).abs().max().item()
            ok = torch.allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
            results.append({"dtype": str(dtype), **opts, "max_abs_err": err, "ok": ok})
            print(f"correct {dtype} {opts}: max |err| {err:.2e} {'ok' if ok else 'FAIL'}")
    return results


def cuda_time_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Median of ``iters`` timed calls after warm-up (CUDA events)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write of 1 GiB)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / (ms / 1e3)


def time_decode(batch: int, context: int, bandwidth: float) -> dict[str, Any]:
    q, k, v, md = make_batch([context] * batch, [1] * batch, torch.bfloat16, seed=batch)
    scale = HEAD_DIM**-0.5
    md.split_rows()  # the SDPA path's per-step metadata, built once as the runner does
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    res = {
        "batch": batch,
        "context": context,
        "triton_ms": cuda_time_ms(lambda: triton_paged_attention(q, k, v, md, scale)),
        "sdpa_gather_ms": cuda_time_ms(lambda: paged_attention(q, k, v, md, scale)),
        "kv_read_floor_ms": kv_bytes / bandwidth * 1e3,
    }
    print(f"decode batch {batch} context {context}: {res}")
    return res


def time_prefill(bandwidth: float) -> dict[str, Any]:
    q, k, v, md = make_batch([1024] * 8, [512] * 8, torch.bfloat16, seed=7)
    scale = HEAD_DIM**-0.5
    md.split_rows()
    res = {
        "rows": 8,
        "queries_per_row": 512,
        "context": 1024,
        "triton_ms": cuda_time_ms(lambda: triton_paged_attention(q, k, v, md, scale), 20),
        "sdpa_ms": cuda_time_ms(lambda: paged_attention(q, k, v, md, scale), 20),
    }
    print(f"prefill: {res}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_kernels.json")
    ap.add_argument("--context", type=int, default=1024, help="decode context per request")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
    }
    print(info)
    correctness = check_correctness()
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s")
    decode = [time_decode(b, args.context, bw) for b in (1, 64)]
    out = {
        **info,
        "copy_bandwidth_gbs": bw / 1e9,
        "correctness": correctness,
        "decode_layer": decode,
        "prefill_layer": time_prefill(bw),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not all(r["ok"] for r in correctness):
        sys.exit("the kernels disagree with the reference")


if __name__ == "__main__":
    main()
