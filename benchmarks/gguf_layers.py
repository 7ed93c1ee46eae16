"""One GGUF file's layers on each kernel path, at a few row counts: int8 activations (the
path ``auto`` or ``--quantization-activations int8`` takes; for byte codes within 6 bits also
the full-range sign-trick path on the same records) against float32 activations (the
weight-only kernel). Min of ``--repeats`` alternating rounds, ms per call, 2 threads.

    # issue 34: a Q4_K_M file's Q6_K layers (the LM head, a Q6_K ffn_down) on an AVX2 CPU
    python benchmarks/gguf_layers.py <model-Q4_K_M.gguf> output.weight blk.0.ffn_down.weight
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGUFReader

from kvserve.config import QuantizedActivations
from kvserve.quantization.gguf_weights import tensor_to_qweight
from kvserve.quantization.qlinear import A8_NARROW, QuantLinear

CPU = torch.device("cpu")


def best_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    fn(x)  # warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


Path = Callable[[torch.Tensor], torch.Tensor]


def paths(layer: QuantLinear, flt: QuantLinear) -> dict[str, Path]:
    """The layer's int8 path, the sign trick on its records where it reads narrow codes, and
    float32 activations."""
    out: dict[str, Path] = {"int8": layer}
    if layer.scale_format & A8_NARROW:

        def sign(x: torch.Tensor) -> torch.Tensor:
            y = x.new_empty(x.shape[0], layer.out_features)  # [M, N]
            torch.ops.kvserve.quant_linear_a8(y, x, layer.codes, 8, layer.group_size, 128,
                                              layer.scale_format & ~A8_NARROW,
                                              layer.has_zeros)  # fmt: skip
            return y

        out["int8 sign trick"] = sign
    out["float32"] = flt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("tensors", nargs="+", help="tensor names, e.g. output.weight")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    found = {t.name: t for t in GGUFReader(args.gguf).tensors if t.name in args.tensors}
    for name in args.tensors:
        t = found[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        qw = tensor_to_qweight(name, t.tensor_type, np.asarray(t.data), n, k)
        layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.INT8)
        flt = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.NONE)
        narrow = "narrow codes" if layer.scale_format & A8_NARROW else "full-range or 4-bit"
        print(f"{name}: {t.tensor_type.name} {n} x {k}, {narrow}")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))  # [M, K]
            calls = max(2, 40 // rows)
            res: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for label, fn in paths(layer, flt).items():
                    res.setdefault(label, []).append(best_ms(fn, x, calls))
            cells = ", ".join(f"{label} {min(v):.3f} ms" for label, v in res.items())
            print(f"  {rows:4d} rows: {cells}")


if __name__ == "__main__":
    main()
