"""Compile the Triton attention kernels for NVIDIA GPUs on a machine without one.

Triton's interpreter (the CPU tests) never lowers a kernel, so it cannot catch what only the
compiler checks: ``tl.dot`` tile shapes, loop-carried types, constexpr branches, register
use. This compiles the kernels ahead of time for a CUDA target (Triton's bundled ptxas; no
GPU, no driver) in each variant the wrapper launches and prints each one's registers, stack
(a stack means spills to local memory) and shared memory. Run with ``TRITON_INTERPRET`` unset:

    python benchmarks/gpu/compile_kernels.py [--arch 90] [--dtypes bf16] [--groups 8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.ops.triton.attention_kernels import decode_kernel, prefill_kernel, reduce_kernel
from kvserve.ops.triton.paged_attention import DEFAULT_TUNING, tile_keys

_PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _signature(fn: triton.JITFunction, types: dict[str, str], consts: dict) -> dict[str, str]:
    """Every argument's type: ``types`` by name, constexprs, else i32 (strides, sizes)."""
    return {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}


_CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"


def _compile(
    fn: triton.JITFunction, types: dict[str, str], consts: dict, target: GPUTarget
) -> tuple[float, str]:
    """Seconds to compile, and the cubin's registers, stack (spills) and shared memory as
    ``cuobjdump --dump-resource-usage`` reads them (the driver fills Triton's own n_regs and
    n_spills only when it loads a binary, which needs a GPU)."""
    src = ASTSource(fn, _signature(fn, types, consts), consts)
    t = time.perf_counter()
    # the wrapper's warps; the reduce kernel launches with Triton's default, 4
    warps = 4 if fn is reduce_kernel else DEFAULT_TUNING.num_warps
    k = triton.compile(src, target=target, options={"num_warps": warps})
    secs = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        dump = subprocess.run(
            [str(_CUOBJDUMP), "--dump-resource-usage", str(cubin)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", dump)
    regs, stack, _ = usage.groups() if usage else ("?", "?", "?")
    return secs, f"regs {regs:>3} stack {stack:>5} B shared {k.metadata.shared:>6} B"


def variants(
    dtypes: list[str], groups: list[int], head_dims: list[int]
) -> list[tuple[triton.JITFunction, dict[str, str], dict]]:
    """The wrapper's launches for these shapes: decode with and without split-K, prefill and
    the reduce, each plain and with both a window and a soft-cap."""
    out = []
    for dt, group, split, opt, head_dim in itertools.product(
        dtypes, groups, [False, True], [False, True], head_dims
    ):
        dot = "ieee" if dt == "fp32" else "tf32"
        ptrs = {a: _PTR[dt] for a in ("out_ptr", "q_ptr", "k_cache", "v_cache")}
        ints = {a: "*i32" for a in ("entry_row", "entry_tok", "entry_len")}
        fl = {"part_acc": "*fp32", "part_ml": "*fp32", "scale": "fp32", "cap": "fp32"}
        common = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, HAS_WINDOW=opt,
                      HAS_CAP=opt, DOT_PRECISION=dot)  # fmt: skip
        block_g = 1 << (group - 1).bit_length()
        t = DEFAULT_TUNING
        dec_n = tile_keys(t.decode_block_n, head_dim, _TORCH[dt], t)
        pre_n = tile_keys(t.prefill_block_n, head_dim, _TORCH[dt], t)
        out.append((
            decode_kernel,
            {**ptrs, **ints, **fl, "block_tables": "*i64"},
            dict(common, GROUP=group, BLOCK_G=max(16, block_g), BLOCK_N=dec_n, SPLIT=split),
        ))  # fmt: skip
        if not split:
            ints = {a: "*i32" for a in ("query_start_loc", "seq_lens", "tile_row", "tile_q0")}
            out.append((
                prefill_kernel,
                {**ptrs, **ints, "scale": "fp32", "cap": "fp32", "block_tables": "*i64"},
                dict(common, GROUP=group, BLOCK_G=block_g,
                     BLOCK_Q=max(1, t.prefill_block_m // block_g), BLOCK_N=pre_n),
            ))  # fmt: skip
    for dt in dtypes:
        out.append((
            reduce_kernel,
            {"out_ptr": _PTR[dt], "part_acc": "*fp32", "part_ml": "*fp32", "entry_tok": "*i32"},
            dict(PARTS_PAD=8, HEAD_DIM=head_dims[-1], HEAD_DIM_PAD=head_dims[-1]),
        ))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "fp16", "bf16"], choices=list(_PTR))
    ap.add_argument("--groups", nargs="+", type=int, default=[1, 4, 8], help="H / Hkv")
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    for fn, types, consts in variants(args.dtypes, args.groups, args.head_dims):
        secs, usage = _compile(fn, types, consts, target)
        flags = " ".join(f"{k}={v}" for k, v in consts.items() if k != "HEAD_DIM_PAD")
        print(f"{fn.__name__:15s} {secs:5.1f} s  {usage}  {flags}", flush=True)


if __name__ == "__main__":
    main()
