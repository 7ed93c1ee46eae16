"""Multi-LoRA deltas on the Triton backend: the GPU counterpart of ``csrc/lora_ops.cpp`` with
the same contract (``kvserve.lora.punica``; reference ``lora_delta_reference``):

    out[t, slice i] += (x[t] @ A[s_t]^T)[rank block i] @ Bt_i[s_t]   for rows with s_t >= 0

Two launches per linear plus one expand per extra slice, as vLLM's ``lora_shrink`` /
``lora_expand`` pair (punica's BGMV: every program reads its row's slot and gathers that
adapter's weights, so a mixed batch needs no sorting and no loop over adapters):

- ``_shrink_kernel``: one program per (row, block of ``n*R``): ``h = x[t] @ A[s]^T`` summed in
  float32 over blocks of K; ``h`` [T, n*R] stays float32 (one rounding fewer than PyTorch's);
- ``_expand_kernel``: one program per (row, block of a slice's channels):
  ``out[t, cols] += h[t, rank block] @ Bt[s, :, cols]``, the sum in float32, rounded once.

Rows with slot -1 return at once. Decode batches are a few rows per adapter, so a row-gather
matvec (memory bound on A and B) is what vLLM's decode path does too; the prefill path there
tiles rows sorted by adapter with ``tl.dot``, which kvserve leaves to the future.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK_K = 64  # shrink: K elements per inner step
_BLOCK_N = 128  # expand: output channels per program


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr, k, nr, stride_x, stride_as, stride_h,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rs < nr
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k
        xv = tl.load(x_ptr + row * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + rs[:, None] * k + ks[None, :],
            mask=rmask[:, None] & kmask[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a * xv[None, :], axis=1)
    tl.store(h_ptr + row * stride_h + rs, acc, mask=rmask)


@triton.jit
def _expand_kernel(
    h_ptr, bt_ptr, out_ptr, slots_ptr, n, r0, rank, stride_h, stride_bs, stride_o, col_off,
    BLOCK_RANK: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    rr = tl.arange(0, BLOCK_RANK)
    rmask = rr < rank
    h = tl.load(h_ptr + row * stride_h + r0 + rr, mask=rmask, other=0.0)  # [BLOCK_RANK]
    bt = tl.load(
        bt_ptr + slot * stride_bs + rr[:, None] * n + cols[None, :],
        mask=rmask[:, None] & cmask[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip  # [BLOCK_RANK, BLOCK_N]
    delta = tl.sum(bt * h[:, None], axis=0)  # [BLOCK_N]
    o_ptrs = out_ptr + row * stride_o + col_off + cols
    o = tl.load(o_ptrs, mask=cmask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + delta).to(o.dtype), mask=cmask)


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bts: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
) -> None:
    """``cpu_kernels.lora_add``'s contract: x ``[T, K]``, out ``[T, sum N_i]`` (unit column
    strides), A ``[S, n*R, K]`` and each Bt ``[S, R, N_i]`` contiguous, token_slots ``[T]``
    int64, all on one device."""
    t, k = x.shape
    nr, rank = a.shape[1], bts[0].shape[1]
    if t == 0:
        return
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous()
    h = torch.empty(t, nr, dtype=torch.float32, device=x.device)  # [T, n*R]
    block_r = min(64, triton.next_power_of_2(nr))
    _shrink_kernel[(t, triton.cdiv(nr, block_r))](
        x, a, h, token_slots, k, nr, x.stride(0), a.stride(0), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    col_off = 0
    for i, bt in enumerate(bts):
        n = bt.shape[2]
        assert bt.is_contiguous()
        _expand_kernel[(t, triton.cdiv(n, _BLOCK_N))](
            h, bt, out, token_slots, n, i * rank, rank, h.stride(0), bt.stride(0),
            out.stride(0), col_off, BLOCK_RANK=triton.next_power_of_2(rank), BLOCK_N=_BLOCK_N,
        )  # fmt: skip
        col_off += n
