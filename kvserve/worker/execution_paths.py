"""Which paths a runner actually took: the facts behind the load log's "fused ops: ...; C++
decode loop: ..." and the thread binding, read back after the model loaded, so benchmarks
record them from ``LLMEngine.execution_paths`` instead of parsing logs (results differ
between CPU kinds and flags by exactly these)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ExecutionPaths:
    """One rank's paths, as measured in its own process after loading and warm-up."""

    fused_ops: bool  # the C++ RMSNorm / SiLU*up / RoPE+KV-write kernels run
    decode_loop: bool  # decode-only steps run every layer in one C++ call
    cpu_capability: str  # what torch's CPU kernels dispatch to (AVX512, AVX2, DEFAULT)
    kernel_cflags: tuple[str, ...]  # the C++ kernels' build flags; () when they are not loaded
    dtype: str  # activations, KV cache and the math (e.g. bfloat16, float32)
    weight_dtype: str  # how linear weights are stored: a dtype, or the quantization method
    num_threads: int  # torch.get_num_threads() in the thread that runs the model
    cpu_affinity: tuple[int, ...]  # that thread's allowed cores (os.sched_getaffinity)
    # each OpenMP thread's allowed cores, read by the thread itself, in thread order (one core
    # each when --cpu-cores binds); () where the OpenMP runtime is not libgomp
    thread_cores: tuple[tuple[int, ...], ...]
    omp_wait_policy: str  # $OMP_WAIT_POLICY as libgomp read it here ("" when unset)
    # the decode batch sizes replayed as CUDA graphs (worker/cuda_graph.py); () when off
    cuda_graphs: tuple[int, ...] = ()
    # --batch-invariant: every row computed in a fixed order (model/batch_invariant.py)
    batch_invariant: bool = False
    # the first decoder linear's kernel (linear_kernel): "packed-bf16" (vdpbf16ps on the
    # packed layout), "packed-widened" (16-bit weights widened to float32), "onednn"
    # (prepacked), "aten" (F.linear; float32 packs only the LM head and gate/up), "quantized"
    # or "invariant" (--batch-invariant); "" where not read
    linears: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_storage(model: nn.Module, dtype: torch.dtype, quantization: str | None) -> str:
    """The linear weights' storage: the quantization method, else a widened layer's 16-bit
    dtype (``--weight-dtype``), else the model dtype."""
    if quantization is not None:
        return quantization
    from kvserve.model.wide_linear import WideLinear

    wide = next((m for m in model.modules() if isinstance(m, WideLinear)), None)
    return _dtype_name(wide.weight_dtype if wide is not None else dtype)


def linear_kernel(model: nn.Module, dtype: torch.dtype) -> str:
    """Which kernel the model's first linear layer (in module order: the first layer's QKV)
    runs (``ExecutionPaths.linears``)."""
    from kvserve.model.batch_invariant import BatchInvariantLinear
    from kvserve.model.wide_linear import WideLinear
    from kvserve.ops.packed_linear import PackedLinear
    from kvserve.quantization.qlinear import QuantLinear

    for m in model.modules():
        if isinstance(m, WideLinear):
            native = torch.ops.kvserve.wide_linear_bf16_isa() == "avx512bf16"
            return "packed-bf16" if dtype == torch.bfloat16 and native else "packed-widened"
        if isinstance(m, PackedLinear):
            return "onednn"
        if isinstance(m, QuantLinear):
            return "quantized"
        if isinstance(m, BatchInvariantLinear):
            return "invariant"
        if isinstance(m, nn.Linear):
            return "aten"
    return ""


def kernel_flags() -> tuple[str, ...]:
    """The C++ kernels' build flags when this process loaded them (never builds them)."""
    from kvserve.ops import cpu_kernels

    if cpu_kernels.available.cache_info().currsize == 0 or not cpu_kernels.available():
        return ()
    return cpu_kernels.kernel_build_spec().cflags


def collect_paths(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    cuda_graphs: tuple[int, ...] = (),
) -> ExecutionPaths:
    """This rank's paths, read back in the thread that loaded (and will run) the model;
    ``cuda_graphs``: the captured decode batch sizes."""
    from kvserve.worker.cpu_binding import omp_thread_cores

    cpu = device.type == "cpu"
    threads = torch.get_num_threads()
    return ExecutionPaths(
        fused_ops=bool(getattr(model, "fused_ops_enabled", False)),
        decode_loop=getattr(model, "decode_loop", None) is not None,
        cpu_capability=torch.backends.cpu.get_cpu_capability() if cpu else device.type,
        kernel_cflags=kernel_flags() if cpu else (),
        dtype=_dtype_name(dtype),
        weight_dtype=weight_storage(model, dtype, quantization),
        num_threads=threads,
        cpu_affinity=tuple(sorted(os.sched_getaffinity(0))),
        thread_cores=omp_thread_cores(threads) if cpu else (),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
        cuda_graphs=cuda_graphs,
        batch_invariant=bool(getattr(model, "batch_invariant", False)),
        linears=linear_kernel(model, dtype),
    )
