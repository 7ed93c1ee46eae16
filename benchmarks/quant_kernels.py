"""Quantized linear kernels against bf16 (oneDNN-prepacked), per layer shape and batch rows.

For each of a model's projection shapes and each row count, times the prepacked bf16 linear
(kvserve's unquantized fast path), PyTorch's own weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) and kvserve's kernel for int8
(per channel) and int4 (group 32): with int8 activations (``a8``: VNNI integer dot products,
the default on VNNI CPUs), and with bf16 activations, each of that kernel's two paths forced:
``direct`` (codes times float32 activations) and ``tiles`` (dequantize to bf16 tiles,
vdpbf16ps). Prints medians in microseconds; the crossing of the two bf16 paths is what
``qlinear.DIRECT_ROWS`` is set from.

    python benchmarks/quant_kernels.py                      # TinyLlama-1.1B's shapes
    python benchmarks/quant_kernels.py --shapes builtin --rows 1,4,16,64
    python benchmarks/quant_kernels.py --streamed --layers 22 --rows 1,8   # weights cold

    python benchmarks/quant_kernels.py --float32 --baseline /tmp/main-tree --alternate 3 \
        --out benchmarks/results/quant_kernels-f32-DATE.json   # AVX2 CPUs: float32 x

``--float32`` (``benchmarks/quant_kernels_f32.py``): float32 activations, the path of CPUs
without AVX512-BF16, at one ``--n`` x ``--k`` shape (TinyLlama-1.1B's MLP by default), weights
streamed from memory, against float32 F.linear and the memory floor; with ``--baseline`` also
another tree's kernel (before / after), with the machine record, to ``--out`` as JSON.

``--streamed``: the four projections of ``--layers`` decoder layers, each with its own
weights (TinyLlama-1.1B: 22 layers, 0.6 GB in int4), run one after the other as a decode step
does, so the weights stream from memory instead of sitting in cache; prints milliseconds per
pass and the bytes read per second, with the int8-activation kernel (the default path).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from kernels import timed  # benchmarks/kernels.py: median seconds after warm-up

from kvserve.config import QuantizedActivations
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import quantize_rtn

SHAPES = {  # name -> [(layer, N, K)]
    "tinyllama": [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048),
                  ("down", 2048, 5632)],
    "builtin": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)],
}  # fmt: skip


def forced(layer: QuantLinear, x: torch.Tensor, direct: bool) -> Callable[[], object]:
    out = x.new_empty(x.shape[0], layer.out_features)
    limit = 1 << 30 if direct else 0

    def run() -> None:
        torch.ops.kvserve.quant_linear(
            out, x, layer.codes, layer.scales_t, layer.zeros_t, layer.bits, layer.group_size,
            layer.offset, limit,
        )  # fmt: skip

    return run


def row_times(n: int, k: int, rows: int, repeats: int) -> dict[str, float]:
    w = torch.randn(n, k) * 0.02
    x = torch.randn(rows, k).bfloat16()
    cpu = torch.device("cpu")
    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
    q8 = QuantLinear(quantize_rtn(w, 8, None), None, cpu, torch.bfloat16)
    q4 = QuantLinear(quantize_rtn(w, 4, 32), None, cpu, torch.bfloat16)
    a8 = QuantizedActivations.INT8
    q8a8 = QuantLinear(quantize_rtn(w, 8, None), None, cpu, torch.bfloat16, a8)
    q4a8 = QuantLinear(quantize_rtn(w, 4, 32), None, cpu, torch.bfloat16, a8)
    # PyTorch's own kernels on the same sizes (random codes: only the time matters)
    w8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, dtype=torch.bfloat16)
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 2
    )
    sz4 = torch.rand(k // 32, n, 2, dtype=torch.bfloat16)
    fns = {
        "bf16 prepacked": lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        ),
        "torch int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
        "torch int4pack g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, 32, sz4),
        "int8 a8": lambda: q8a8(x),
        "int4 a8": lambda: q4a8(x),
        "int8 direct": forced(q8, x, True),
        "int8 tiles": forced(q8, x, False),
        "int4 direct": forced(q4, x, True),
        "int4 tiles": forced(q4, x, False),
    }
    return {name: timed(fn, repeats) * 1e6 for name, fn in fns.items()}


def streamed(
    shapes: list[tuple[str, int, int]], layers: int, rows: list[int], repeats: int
) -> None:
    """Milliseconds per pass over ``layers`` layers' own weights, int8 and int4 (a8 path)."""
    cpu, a8 = torch.device("cpu"), QuantizedActivations.INT8
    print("| weights | rows | ms per pass | GB read | GB/s |")
    print("|---|---|---|---|---|")
    for bits, group in ((8, None), (4, 32)):
        base = {(n, k): quantize_rtn(torch.randn(n, k) * 0.02, bits, group) for _, n, k in shapes}
        stack = [QuantLinear(base[(n, k)], None, cpu, torch.bfloat16, a8)
                 for _ in range(layers) for _, n, k in shapes]  # fmt: skip
        nbytes = sum(q.nbytes for q in stack)
        for m in rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, _, k in shapes}

            def run(stack: list[QuantLinear] = stack, xs: dict = xs) -> None:
                for q in stack:
                    q(xs[q.in_features])

            t = timed(run, repeats)
            rate = nbytes / t / 1e9
            print(f"| int{bits} | {m} | {t * 1e3:.2f} | {nbytes / 1e9:.3f} | {rate:.1f} |")
        del stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tinyllama")
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,64,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--streamed", action="store_true", help="weights cold, see above")
    ap.add_argument("--layers", type=int, default=22, help="with --streamed")
    ap.add_argument("--float32", action="store_true", help="float32 activations, see above")
    ap.add_argument("--n", type=int, default=5632, help="with --float32")
    ap.add_argument("--k", type=int, default=2048, help="with --float32")
    ap.add_argument("--stream-mb", type=int, default=256, help="with --float32")
    ap.add_argument("--baseline", help="with --float32: another tree's kvserve to compare")
    ap.add_argument("--alternate", type=int, default=1, help="with --float32: runs per tree")
    ap.add_argument("--out", help="with --float32: write the results here as JSON")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="with --float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.float32:
        float32_main(args)
        return
    if not cpu_kernels.available() or not torch.ops.kvserve.quant_linear_a8_supported():
        raise SystemExit("the quantized kernels need the C++ kernels, AVX512-BF16 and VNNI")
    rows = [int(r) for r in args.rows.split(",")]
    if args.streamed:
        streamed(SHAPES[args.shapes], args.layers, rows, min(args.repeats, 10))
        return
    cols = None
    totals: dict[int, dict[str, float]] = {}
    for layer, n, k in SHAPES[args.shapes]:
        for m in rows:
            t = row_times(n, k, m, args.repeats)
            if cols is None:
                cols = list(t)
                print("| layer | rows | " + " | ".join(cols) + " |")
                print("|---|---|" + "---|" * len(cols))
            print(f"| {layer} {n}x{k} | {m} | " + " | ".join(f"{t[c]:.0f}" for c in cols) + " |")
            acc = totals.setdefault(m, dict.fromkeys(t, 0.0))
            for c in cols:
                acc[c] += t[c]
    assert cols is not None
    print("\nall four layers, microseconds (one decoder layer's projections):")
    print("| rows | " + " | ".join(cols) + " | int8 best / bf16 | int4 best / bf16 |")
    print("|---|" + "---|" * (len(cols) + 2))
    for m, t in totals.items():
        i8 = min(t["int8 a8"], t["int8 direct"], t["int8 tiles"]) / t["bf16 prepacked"]
        i4 = min(t["int4 a8"], t["int4 direct"], t["int4 tiles"]) / t["bf16 prepacked"]
        cells = " | ".join(f"{t[c]:.0f}" for c in cols)
        print(f"| {m} | {cells} | {i8:.2f} | {i4:.2f} |")


def float32_main(args: argparse.Namespace) -> None:
    import json

    import quant_kernels_f32 as f32
    from machine import machine_info

    args.rows = [int(r) for r in args.rows.split(",")]
    res = f32.compare(args)
    print(f32.table(res["summary"], args.rows))
    if args.out:
        record = {"benchmark": "quant_kernels --float32", "n": args.n, "k": args.k,
                  "threads": args.threads, "repeats": args.repeats, "stream_mb": args.stream_mb,
                  "clock": args.clock,
                  "alternate": args.alternate, "machine": machine_info(),
                  "lscpu": f32.lscpu_record(), **res}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
