"""A layer's routed experts on the Triton backend: the GPU counterpart of ``grouped_experts``
(``kvserve/moe/experts.py``, the PyTorch path and its contract) and of the C++ experts op.

On a GPU the PyTorch path is slow twice over: it reads every active expert's token count on
the host (a sync per layer) and launches two matmuls per active expert (up to 64 x 2 small
launches per layer for OLMoE). Here, as in vLLM's ``fused_moe`` and SGLang's
``fused_moe_triton``, the step's ``T * k`` (token, expert) pairs are laid out by expert with
each expert's run padded to a whole number of ``BLOCK_M`` rows (:func:`align_pairs`, torch
ops on the device, no host sync: the launch covers the most blocks any routing can need and
blocks past the end return at once), and one launch per projection runs every block of rows
against its expert's weight with ``tl.dot``:

- gate/up: ``h[p] = x[token(p)] @ gate_up[e(p)]^T (+ bias)`` for every pair ``p``, in float32,
  stored in the model dtype ``[T * k, 2I]``; the activation (``act_and_mul``, the model's own
  function) makes ``[T * k, I]``;
- down: ``y[p] = (h[p] @ down[e(p)]^T (+ bias)) * weight[p]``, kept in float32 ``[T * k, H]``;
  the k pairs of a token are summed in float32 and rounded to the model dtype once.

The rounding therefore differs from the PyTorch path (which rounds each expert's output, and
sums in the model dtype in expert order): the tests hold the two within the dtype's tolerance.
float32 runs ``tl.dot`` in full precision (``input_precision="ieee"``, not TF32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

__all__ = ["align_pairs", "fused_experts"]

BLOCK_M = 16  # rows (pairs) of one expert per program: decode gives an expert a few rows
_BLOCK_N = 64
_BLOCK_K = 32


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, k]`` (int) -> ``sorted_pairs [B * block_m]`` (each slot's pair index
    ``t * k + j``, or ``T * k`` for padding) and ``block_expert [B]`` (each block's expert, or
    -1 past the last one), where ``B`` is the most blocks any routing of ``T * k`` pairs over
    ``num_experts`` experts needs. Pairs of one expert keep token order."""
    flat = ids.reshape(-1).long()  # [P] expert of each pair
    pairs = flat.numel()
    # [E] pairs per expert (a scatter, not bincount: bincount's size needs the max on the host)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E] each expert's run, padded
    ends = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert, token order within
    by_expert = flat[order]  # [P]
    first = torch.cumsum(counts, 0) - counts  # [E] each expert's first index in `order`
    rank = torch.arange(pairs, device=ids.device) - first[by_expert]  # [P] place in its run
    dest = (ends - padded)[by_expert] + rank  # [P] slot of each sorted pair
    blocks = triton.cdiv(pairs + min(pairs, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[dest] = order
    starts = torch.arange(blocks, device=ids.device) * block_m  # [B] each block's first slot
    block_expert = torch.searchsorted(ends, starts, right=True)  # [B]
    block_expert = torch.where(starts < ends[-1], block_expert, -1)
    return sorted_pairs, block_expert


@triton.jit
def _experts_matmul(
    a_ptr, w_ptr, c_ptr, bias_ptr, rw_ptr, sorted_ptr, block_expert_ptr,
    n, k, num_pairs, a_div, stride_a, stride_we, stride_wn, stride_c, stride_be,
    HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One block of one expert's pairs x one block of output channels:
    ``c[p, cols] = (a[p // a_div] @ w[e, cols]^T + bias[e, cols]) * rw[p]``."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // a_div, 0)  # [BLOCK_M] rows of a
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & kmask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)[
            None, :
        ]
    if MUL_WEIGHT:
        acc *= tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pairs[:, None] * stride_c + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


def _matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor | None,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    a_div: int,
) -> None:
    """``out [P, N]`` rows of every pair: ``a [rows, K]`` (row ``p // a_div``) times its
    expert's ``w [E, N, K]``, plus ``bias [E, N]``, times ``weights [P]``."""
    n, k = w.shape[1], w.shape[2]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32: unused off float32
    grid = (block_expert.numel(), triton.cdiv(n, _BLOCK_N))
    _experts_matmul[grid](
        a, w, out, bias if bias is not None else w, weights if weights is not None else out,
        sorted_pairs, block_expert, n, k, out.shape[0], a_div, a.stride(0), w.stride(0),
        w.stride(1), out.stride(0), bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None, PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grouped_experts``' contract on dense stacked weights: ``x [T, H]``, ``gate_up
    [E, 2I, H]``, ``down [E, H, I]``, ``weights``/``ids [T, k]`` -> ``[T, H]`` in ``x``'s
    dtype; ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]`` optional."""
    t, k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_expert = align_pairs(ids, gate_up.shape[0])
    pairs = t * k
    h = torch.empty(pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)  # [P, 2I]
    _matmul(x, gate_up, h, gate_up_bias, None, sorted_pairs, block_expert, a_div=k)
    act = act_and_mul(h).contiguous()  # [P, I]
    y = torch.empty(pairs, down.shape[1], dtype=torch.float32, device=x.device)  # [P, H]
    rw = weights.reshape(-1).contiguous()  # [P] each pair's routing weight
    _matmul(act, down, y, down_bias, rw, sorted_pairs, block_expert, a_div=1)
    return y.view(t, k, -1).sum(1).to(x.dtype)  # [T, H]: a token's k pairs, rounded once
