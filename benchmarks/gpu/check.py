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

Writes one JSON (``--out``). Not a test: nothing here asserts a speed. ``--device cpu``
(with ``TRITON_INTERPRET=1``) runs the same steps on short contexts in Triton's interpreter,
to try the script where there is no GPU; its times mean nothing.

    python benchmarks/gpu/check.py --out benchmarks/results/gpu_kernels.json
    TRITON_INTERPRET=1 python benchmarks/gpu/check.py --device cpu --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402

from kvserve.attention.paged import (  # noqa: E402
    AttentionMetadata,
    paged_attention,
    reference_paged_attention,
)
from kvserve.ops.triton.paged_attention import interpreted, triton_paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16  # Llama-3.2-1B
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}  # tests/ops' tolerances


def make_batch(
    lens: list[int], qlens: list[int], dtype: torch.dtype, device: torch.device, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q ``[T, H, D]``, caches ``[NB, Hkv, BS, D]`` on ``device`` and metadata; each row's
    blocks are scattered over a cache twice the needed size."""
    g = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    nb = 2 * sum(need) + 1
    pool = torch.randperm(nb, device=device, generator=g).tolist()
    tables = []
    for m in need:
        tables.append(pool[:m] + [0] * (max(need) - m))
        pool = pool[m:]
    shape = (nb, KV_HEADS, BLOCK, HEAD_DIM)
    k = torch.randn(shape, device=device, generator=g).to(dtype)
    v = torch.randn(shape, device=device, generator=g).to(dtype)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, device=device, generator=g).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        query_start_loc=qsl,
        seq_lens=list(lens),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        block_size=BLOCK,
    )
    return q, k, v, md


def check_correctness(device: torch.device, shrink: int) -> list[dict[str, Any]]:
    """Every dtype and option on one mixed batch (contexts divided by ``shrink``)."""
    lens = [1] + [n // shrink for n in (700, 1500, 64, 900, 300)]
    qlens = [1, 1, 1, 64 // shrink, 200 // shrink, 4]
    dtypes = [torch.float32, torch.float16]
    if device.type == "cuda":  # the interpreter computes bf16 dots wrongly (triton#11584)
        dtypes.append(torch.bfloat16)
    results = []
    for dtype in dtypes:
        for opts in ({}, {"sliding_window": 100 // shrink}, {"soft_cap": 1.0}):
            q, k, v, md = make_batch(lens, qlens, dtype, device)
            md.spec_rows = frozenset({5})
            scale = HEAD_DIM**-0.5
            want = reference_paged_attention(q, k, v, md, scale, **opts)
            got = triton_paged_attention(q, k, v, md, scale, **opts)
            err = (got.float() - want.float()).abs().max().item()
            ok = torch.allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])
            results.append({"dtype": str(dtype), **opts, "max_abs_err": err, "ok": ok})
            print(f"correct {dtype} {opts}: max |err| {err:.2e} {'ok' if ok else 'FAIL'}")
    return results


def time_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Median of ``iters`` timed calls after warm-up (CUDA events; the clock on a CPU)."""
    if interpreted():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
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


def kernel_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """GPU time of the kernels ``fn`` runs, per call, from the profiler: event timing of one
    call measures the host's launch gaps too (a batch-1 decode layer's Python launch path
    took longer than its kernels on the H200). 0 where there is no GPU."""
    if interpreted():
        return 0.0
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    return us / calls / 1e3


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Copy bandwidth on ``device``, bytes/s (read + write of ``size`` bytes)."""
    x = torch.empty(size, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / (ms / 1e3)


def time_decode(
    batch: int, context: int, bandwidth: float, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    q, k, v, md = make_batch([context] * batch, [1] * batch, dtype, device, seed=batch)
    scale = HEAD_DIM**-0.5
    md.split_rows()  # the SDPA path's per-step metadata, built once as the runner does
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k.element_size()
    res = {
        "batch": batch,
        "context": context,
        "triton_ms": time_ms(lambda: triton_paged_attention(q, k, v, md, scale)),
        "sdpa_gather_ms": time_ms(lambda: paged_attention(q, k, v, md, scale)),
        "triton_kernel_ms": kernel_ms(lambda: triton_paged_attention(q, k, v, md, scale)),
        "sdpa_gather_kernel_ms": kernel_ms(lambda: paged_attention(q, k, v, md, scale)),
        "kv_read_floor_ms": kv_bytes / bandwidth * 1e3,
    }
    print(f"decode batch {batch} context {context}: {res}")
    return res


def time_prefill(
    rows: int, queries: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """``rows`` prompts of ``queries`` tokens after as many cached tokens each."""
    q, k, v, md = make_batch([2 * queries] * rows, [queries] * rows, dtype, device, seed=7)
    scale = HEAD_DIM**-0.5
    md.split_rows()
    res = {
        "rows": rows,
        "queries_per_row": queries,
        "context": 2 * queries,
        "triton_ms": time_ms(lambda: triton_paged_attention(q, k, v, md, scale), 20),
        "sdpa_ms": time_ms(lambda: paged_attention(q, k, v, md, scale), 20),
        "triton_kernel_ms": kernel_ms(lambda: triton_paged_attention(q, k, v, md, scale)),
        "sdpa_kernel_ms": kernel_ms(lambda: paged_attention(q, k, v, md, scale)),
    }
    print(f"prefill: {res}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_kernels.json")
    ap.add_argument("--context", type=int, default=1024, help="decode context per request")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (interpreter)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    if device.type == "cpu" and not interpreted():
        sys.exit("--device cpu needs TRITON_INTERPRET=1")
    gpu = device.type == "cuda"
    if gpu and device.index is not None:
        torch.cuda.set_device(device)
    # the interpreter's ~3 ms per program: contexts / 10, batch 4 for 64, fp16 for bf16
    shrink, big, dtype = (1, 64, torch.bfloat16) if gpu else (10, 4, torch.float16)
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
    }
    print(info)
    correctness = check_correctness(device, shrink)
    bw = copy_bandwidth(device, (1 << 30) // shrink)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    ctx = args.context // shrink
    decode = [time_decode(b, ctx, bw, dtype, device) for b in (1, big)]
    out = {
        **info,
        "dtype": str(dtype),
        "copy_bandwidth_gbs": bw / 1e9,
        "correctness": correctness,
        "decode_layer": decode,
        "prefill_layer": time_prefill(8 // (1 if gpu else 4), 512 // shrink, dtype, device),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not all(r["ok"] for r in correctness):
        sys.exit("the kernels disagree with the reference")


if __name__ == "__main__":
    main()
