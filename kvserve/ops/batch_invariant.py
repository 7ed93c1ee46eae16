"""Batch-invariant linear algebra: a row's result depends on that row alone.

``F.linear`` on a CPU goes through oneDNN/MKL, which choose a GEMV for one row and a blocked
GEMM for more, and block K (and split work between threads) by the number of rows: the same
token row gets sums added in another order, so another last bit, depending on what it is
batched with (random 2-layer Llamas, hidden 64 and 256, one greedy request's 16 top-2
logprobs: 2 to 9 changed in float32 beside 1, 5 or 31 others; in bf16 12 to 16 beside 31).

``invariant_linear`` computes every output with one fixed sequence of operations whatever the
number of rows: the ``wide_linear`` C++ kernel (``csrc/wide_linear.cpp``) with no row limit,
which sums each (row, channel) 8 products at a time with FMAs along K, then the same horizontal
sum and scalar tail, with channels (never K) split between threads. bf16 activations are
widened to float32 (exact) and the result rounded back once, as oneDNN rounds a bf16 linear.
A CPU without AVX2 runs the kernel's scalar loop, fixed-order too. ``reference_invariant_linear``
is the pure-PyTorch yardstick (the same product, exact in float64), held within float32
rounding of it in the tests.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# vLLM's switch for its batch-invariant mode; kvserve honours it as --batch-invariant.
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"

_NO_ROW_LIMIT = 0  # wide_linear's direct_rows: the kernel takes every row, never at::linear


def batch_invariant_from_env() -> bool:
    """``$VLLM_BATCH_INVARIANT`` set to 1 / true (vLLM's values); anything else is off."""
    return os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower() in ("1", "true")


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]`` (float32 or bf16) and ``weight [N, K]``
    (float32, bf16 or fp16), each output summed in the same fixed order whatever the number
    of rows; returns ``[..., N]`` in ``x``'s dtype."""
    shape = x.shape
    x32 = x.reshape(-1, shape[-1]).float()  # [M, K]: exact for bf16
    b32 = None if bias is None else bias.float()
    y = torch.ops.kvserve.wide_linear(x32, weight.contiguous(), b32, _NO_ROW_LIMIT)  # [M, N]
    return y.to(x.dtype).view(*shape[:-1], weight.shape[0])


def reference_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The product ``invariant_linear`` computes, in float64 (exact sums for the tests):
    ``[..., K]`` -> float64 ``[..., N]``."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b)
