"""Compile the fused Triton kernels (``kvserve/ops/triton/fused_ops.py``) for an NVIDIA GPU on a
machine without one, as ``compile_kernels.py`` does for the attention kernels: the interpreter
(the CPU tests) never lowers a kernel, this catches what only the compiler checks. Run with
``TRITON_INTERPRET`` unset:

    python benchmarks/gpu/compile_fused.py [--arch 90]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.ops.triton.fused_ops import (
    _ACT_BLOCK,
    _act_and_mul_kernel,
    _rms_norm_kernel,
    _rope_write_kv_kernel,
)

_PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def variants(hidden: int, head_dim: int) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    out: list[tuple[Any, dict[str, str], dict[str, Any]]] = []
    for dt, add, unit in itertools.product(_PTR, [False, True], [False, True]):
        ptrs = {a: _PTR[dt] for a in ("out_ptr", "res_ptr", "x_ptr", "w_ptr")}
        consts = {"ADD": add, "UNIT_OFFSET": unit, "BLOCK": triton.next_power_of_2(hidden)}
        out.append((_rms_norm_kernel, {**ptrs, "eps": "fp32"}, consts))
    for dt, gelu in itertools.product(_PTR, [False, True]):
        ptrs = {a: _PTR[dt] for a in ("out_ptr", "in_ptr")}
        out.append((_act_and_mul_kernel, ptrs, {"GELU": gelu, "BLOCK": _ACT_BLOCK}))
    for dt, norm, unit, inter in itertools.product(
        _PTR, [False, True], [False, True], [False, True]
    ):
        if unit and not norm:
            continue
        names = ("q_ptr", "qkv_ptr", "cos_ptr", "sin_ptr", "k_cache", "v_cache", "qw_ptr", "kw_ptr")
        types = {**{a: _PTR[dt] for a in names}, "slot_ptr": "*i64", "eps": "fp32"}
        consts = {
            "HEAD_DIM": head_dim,
            "HALF": head_dim // 2,
            "HALF_PAD": triton.next_power_of_2(head_dim // 2),
            "NORM": norm,
            "UNIT_OFFSET": unit,
            "INTERLEAVED": inter,
        }
        out.append((_rope_write_kv_kernel, types, consts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--hidden", type=int, default=2048)  # Llama-3.2-1B
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    for fn, types, consts in variants(args.hidden, args.head_dim):
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        t = time.perf_counter()
        k = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4})
        flags = " ".join(f"{n}={v}" for n, v in consts.items())
        print(
            f"{fn.__name__:24s} {time.perf_counter() - t:5.1f} s  "
            f"{types.get('x_ptr', types.get('in_ptr', types.get('qkv_ptr')))}  {flags}  "
            f"shared {k.metadata.shared} B",
            flush=True,
        )


if __name__ == "__main__":
    main()
