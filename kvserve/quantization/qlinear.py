"""``QuantLinear``: a weight-only quantized linear layer behind ``nn.Linear``'s interface.

Activations stay in the model dtype (bf16 or float32); the weight is int8 or int4 codes with
group scales (``QuantizedWeight``). On a CPU the C++ kernel (``csrc/quant_linear.cpp``) reads
the codes in a tile layout made once here (``pack_codes``); elsewhere, or where the kernel
cannot run, the layer dequantizes and calls ``F.linear`` (``reference_linear``, the reference
the kernel is tested against: slow, since it rebuilds the full weight every call).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import cpu_kernels
from kvserve.quantization.qweight import INT4_RANGES, QuantizedWeight

logger = logging.getLogger(__name__)

# bf16 batches of up to this many rows take the kernel's direct path (codes times float32
# activations, a scale per group) instead of dequantizing to bf16 tiles for vdpbf16ps.
# Measured (benchmarks/quant_kernels.py, TinyLlama-1.1B's four projections, AMD EPYC Zen 5,
# 2 threads, us): 4 rows int8 direct 1030 / tiles 1357, 8 rows 2049 / 1751.
DIRECT_ROWS = 4


def reference_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [.., K] @ dequant(W)^T + bias`` with the weight dequantized to ``x``'s dtype."""
    return F.linear(x, qw.dequantize(x.dtype), bias)


def int4_offset(codes: torch.Tensor) -> int:
    """8 for int4 codes in [-8, 7], 0 for codes in [0, 15] (the kernel stores code + offset)."""
    lo, hi = int(codes.min()), int(codes.max())
    for first, last in INT4_RANGES:
        if first <= lo and hi <= last:
            return -first
    raise ValueError(f"int4 codes span [{lo}, {hi}], not one of {INT4_RANGES}")


def pack_codes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Codes ``[N, K]`` in the kernel's tile layout, and the int4 offset (0 for int8).

    int8: ``[N/16, K/2, 2, 16]`` (16 channels of k, then of k + 1); int4: ``[N/16, K/2, 16]``
    bytes holding ``(c[k] + off) | (c[k + 1] + off) << 4``. See ``csrc/quant_linear.cpp``.
    """
    n, k = codes.shape
    blocks = codes.reshape(n // 16, 16, k // 2, 2)  # [N/16, 16, K/2, 2]
    if bits == 8:
        return blocks.permute(0, 2, 3, 1).contiguous(), 0
    off = int4_offset(codes)
    u = (blocks.to(torch.int16) + off).to(torch.uint8)  # [N/16, 16, K/2, 2] in [0, 15]
    packed = u[..., 0] | (u[..., 1] << 4)  # [N/16, 16, K/2]
    return packed.permute(0, 2, 1).contiguous(), off


def kernel_supports(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C++ kernel can run this weight for activations of ``dtype`` on ``device``."""
    n, _ = qw.shape
    if device.type != "cpu" or n % 16:
        return False
    if dtype == torch.bfloat16 and not _bf16_kernel():
        return False
    return dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()


@functools.cache
def _bf16_kernel() -> bool:
    """bf16 activations need AVX512-BF16 (vdpbf16ps), known once the kernels are built."""
    return cpu_kernels.available() and bool(torch.ops.kvserve.quant_linear_bf16_supported())


class QuantLinear(nn.Module):
    """``y = x @ dequant(W)^T + b`` for a ``QuantizedWeight`` W; activations in ``dtype``."""

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits = qw.bits
        self.group_size = qw.group_size
        self.nbytes = qw.nbytes()
        # Plain attributes, not parameters or buffers: model.to(dtype) must not cast scales,
        # and the codes are opaque to everything but this layer.
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
        self.use_kernel = kernel_supports(qw, device, dtype)
        self.qweight: QuantizedWeight | None = None
        if self.use_kernel:
            self.codes, self.offset = pack_codes(qw.codes, qw.bits)
            self.scales_t = qw.scales.t().contiguous()  # [K/g, N]
            self.zeros_t = (
                torch.empty(0, dtype=qw.scales.dtype)
                if qw.zeros is None
                else qw.zeros.t().contiguous()
            )
        else:
            logger.warning(
                "no quantized-linear kernel for %s %s: dequantizing every call (slow)",
                device,
                dtype,
            )
            self.qweight = QuantizedWeight(
                qw.codes.to(device), qw.scales.to(device),
                None if qw.zeros is None else qw.zeros.to(device), qw.bits, qw.group_size,
            )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return reference_linear(x, self.qweight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        out = x2.new_empty(x2.shape[0], self.out_features)  # [M, N]
        torch.ops.kvserve.quant_linear(
            out, x2, self.codes, self.scales_t, self.zeros_t, self.bits, self.group_size,
            self.offset, DIRECT_ROWS,
        )  # fmt: skip
        if self.bias is not None:
            out += self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, kernel={self.use_kernel}"
        )
