"""Linear layers with 16-bit weights in kvserve's packed layout: computed in float32
(``--weight-dtype``), or in bf16 on CPUs with AVX512-BF16 (``bf16_kernel_linears``).

On CPUs without bf16 arithmetic (AVX2-only) kvserve computes in float32 (``dtype=auto``), and a
decode step is paid in bytes of weights read. ``WideLinear`` keeps the weights in bfloat16 or
float16, half the bytes, and widens them to float32 in registers (``csrc/wide_linear.cpp``):
the product of the stored weights, exactly as ``F.linear(x, W.float())`` computes it but summed
in another order. A checkpoint stored in bf16 (most are) loses nothing; a float32 one is
rounded to bf16 once, at load.

The weights are stored once, at load, in the layout the kernel reads (``pack_wide_weight``):
``[ceil(N / 16), K, 16]``, strips of 16 output channels with the 16 channels of each k
contiguous (channels past N zeros), so no call transposes or widens them into a buffer.
``unpack_wide_weight`` gives the ``[N, K]`` weight back.

A bf16 model on a CPU with AVX512-BF16 and no AMX keeps its weights in the same layout and
multiplies them by bf16 activations with ``vdpbf16ps`` (``csrc/wide_packed_bf16.h``; the layer
then returns bf16): one bf16 layout for every row count, where oneDNN's prepacked one-row path
read the weights at 22.8 of this machine's 30.8 GB/s (8 x 46 MB weights, 2 threads; the kernel
30.3 GB/s). Against oneDNN's prepacked weights, all of a TinyLlama-1.1B step's linears (AMD
EPYC Zen 5 kind, 2 threads, medians of 5): 1.27x faster at 1 row, 1.17x at 8, 1.03x at 32,
0.96-0.98x at 64-256 (both at this VM's bf16 peak there).

The reference is ``reference_wide_linear``; tests hold the kernel to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import CpuLinearKernel
from kvserve.distributed.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)

WEIGHT_DTYPES = (torch.bfloat16, torch.float16)

# The classes whose forward at one rank is nn.Linear's F.linear (the tensor-parallel layers add
# communication only for world_size > 1; ParallelLMHead gathers nothing at one rank).
_PLAIN = (nn.Linear, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
          RowParallelLinear, ParallelLMHead)  # fmt: skip


STRIP = 16  # output channels per strip of the packed layout (kStrip in csrc/wide_linear.cpp)


def pack_wide_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` (same dtype): ``packed[s, k, j]`` is
    ``weight[16 * s + j, k]``, zero past N."""
    n, k = weight.shape
    strips = -(-n // STRIP)
    padded = weight
    if n % STRIP:
        padded = weight.new_zeros(strips * STRIP, k)  # [N16, K]
        padded[:n] = weight
    return padded.reshape(strips, STRIP, k).transpose(1, 2).contiguous()


def unpack_wide_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_wide_weight``'s inverse: ``[ceil(N / 16), K, 16]`` -> a new ``[N, K]``."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n].clone()


def reference_wide_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` float32 ``[..., K]``, ``weight`` 16-bit ``[N, K]`` -> float32 ``[..., N]`` (float64
    ``x`` gives exact sums: the tests' yardstick)."""
    return F.linear(x, weight.to(x.dtype), bias)


class WideLinear(nn.Module):
    """``y = x @ W^T + b`` with W stored in ``weight_dtype``, b in float32 and x, y float32 (or
    both bf16 with bf16 W: the products summed in float32, rounded once)."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype) -> None:
        super().__init__()
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be bfloat16 or float16, got {weight_dtype}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Plain attributes, as PackedLinear's: model.to(dtype) must not widen them again. The
        # only copy of the weights: the C++ decode loop reads this very tensor.
        self.packed_weight = pack_wide_weight(
            linear.weight.detach().to(weight_dtype)
        )  # [ceil(N / 16), K, 16]
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        # the most rows the kernel takes before a widened copy goes to F.linear (-1: the
        # kernel's default, 1024 float32 rows on AVX2, 256 in the scalar build; 0: every row,
        # batch-invariant mode, model/batch_invariant.py)
        self.direct_rows = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.kvserve.wide_linear_packed(
            x.reshape(-1, self.in_features),
            self.packed_weight,
            self.bias,
            self.out_features,
            self.direct_rows,
        )  # [M, N]
        return y.view(*shape[:-1], self.out_features)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.packed_weight.dtype

    def unpacked_weight(self) -> torch.Tensor:
        """A new ``[N, K]`` copy of the stored weight (tests, references)."""
        return unpack_wide_weight(self.packed_weight, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}")  # fmt: skip


def widen_linears(model: nn.Module, weight_dtype: torch.dtype) -> int:
    """Replace every one-rank plain linear layer of ``model`` (float32, or bf16 with bf16
    ``weight_dtype``; the LM head too, a tied one with its own copy; the embedding keeps its
    table) by a ``WideLinear``; returns how many."""
    count = 0
    for name, child in list(model.named_children()):
        if type(child) in _PLAIN and getattr(getattr(child, "tp", None), "world_size", 1) == 1:
            assert isinstance(child, nn.Linear)
            setattr(model, name, WideLinear(child, weight_dtype))
            count += 1
        else:
            count += widen_linears(child, weight_dtype)
    return count


def _model_refusal(device: torch.device, *, native: bool, quantized: bool, tp: int) -> str | None:
    """Why a model's linears cannot take the packed layout (None: they can)."""
    if device.type != "cpu":
        return f"it is a CPU path, and the device is {device.type}"
    if not native:
        return "it needs one of kvserve's native model classes, not the transformers backend"
    if quantized:
        return "quantized linears keep their own weights"
    if tp != 1:
        return "it runs one rank (tensor_parallel_size 1)"
    return None


def bf16_kernel_linears(
    requested: CpuLinearKernel,
    dtype: torch.dtype,
    device: torch.device,
    *,
    native: bool,
    quantized: bool,
    tp: int,
) -> bool:
    """Whether a bf16 model's linear layers become bf16 ``WideLinear`` layers (the packed
    layout times bf16 activations, ``vdpbf16ps``) rather than oneDNN's prepacked ones
    (``--cpu-linear-kernel``). Auto: where the kernels have AVX512-BF16 and the CPU has no AMX
    (oneDNN's AMX tiles were not measured against it), for a native one-rank model with
    unquantized linears. ``packed`` where it cannot apply is refused."""
    from kvserve.ops import cpu_kernels  # builds the kernels on first use

    if requested is CpuLinearKernel.ONEDNN:
        return False
    why = _model_refusal(device, native=native, quantized=quantized, tp=tp)
    if dtype != torch.bfloat16:
        why = f"it is for bfloat16 models (dtype is {dtype}; float32: see --weight-dtype)"
    elif why is None and not cpu_kernels.available():
        why = "its kernel needs kvserve's C++ CPU kernels, which are not built"
    if requested is CpuLinearKernel.PACKED:
        if why is not None:
            raise ValueError(f"cpu_linear_kernel packed: {why}")
        return True
    if why is not None or "amx_bf16" in cpu_kernels.cpu_flags():
        return False
    return bool(torch.ops.kvserve.wide_linear_bf16_isa() == "avx512bf16")


def resolve_weight_dtype(
    requested: torch.dtype | None,
    dtype: torch.dtype,
    device: torch.device,
    checkpoint_dtype: torch.dtype | None,
    *,
    native: bool,
    quantized: bool,
    tp: int,
) -> torch.dtype | None:
    """The 16-bit dtype to store the linear weights in, or None to keep them in ``dtype``.

    ``requested`` None is ``auto``: the checkpoint's own 16-bit dtype where kvserve computes
    in float32 on a CPU (``dtype=auto`` on AVX2-only CPUs), so nothing is rounded; anything
    else keeps ``dtype``. An explicit 16-bit request that cannot be honoured is refused.
    """
    from kvserve.ops import cpu_kernels  # builds the kernels on first use

    why = _model_refusal(device, native=native, quantized=quantized, tp=tp)
    if dtype != torch.float32:
        why = f"it is computed in float32, and dtype is {dtype}"
    if requested is None:
        ok = why is None and checkpoint_dtype in WEIGHT_DTYPES and cpu_kernels.available()
        return checkpoint_dtype if ok else None
    if requested == dtype:
        return None
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be auto, bfloat16, float16 or float32: {requested}")
    if why is None and not cpu_kernels.available():
        why = "its kernel needs kvserve's C++ CPU kernels, which are not built"
    if why is not None:
        raise ValueError(f"weight_dtype {str(requested).removeprefix('torch.')}: {why}")
    return requested
