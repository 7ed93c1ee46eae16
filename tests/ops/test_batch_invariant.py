"""Batch-invariant linear (``kvserve/ops/batch_invariant.py``): a row's result is bitwise the
same whatever rows share the call (1..64 rows, any split of a batch, any place in it, float32
and bf16 activations, float32 / bf16 / fp16 weights), within float32 rounding of the exact
product, and ``F.linear`` itself is not invariant here (what makes the mode needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops import cpu_kernels
from kvserve.ops.batch_invariant import (
    batch_invariant_from_env,
    invariant_linear,
    reference_invariant_linear,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

CASES = [  # (x dtype, weight dtype)
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
]


@pytest.mark.parametrize(("xdtype", "wdtype"), CASES)
@pytest.mark.parametrize(("n", "k"), [(13, 67), (96, 576)])  # channel and K tails; a real K
def test_rows_do_not_depend_on_their_batch(
    xdtype: torch.dtype, wdtype: torch.dtype, n: int, k: int
) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(64, k, generator=g).to(xdtype)  # [64, K]
    w = torch.randn(n, k, generator=g).to(wdtype)  # [N, K]
    bias = torch.randn(n, generator=g)
    whole = invariant_linear(x, w, bias)  # [64, N]
    assert whole.dtype == xdtype
    alone = torch.cat([invariant_linear(x[i : i + 1], w, bias) for i in range(64)])
    assert torch.equal(whole, alone)
    for m in (2, 3, 7, 17, 33, 63):  # every prefix length, and an uneven split of the rest
        assert torch.equal(invariant_linear(x[:m], w, bias), whole[:m]), m
        assert torch.equal(invariant_linear(x[m:], w, bias), whole[m:]), m
    perm = torch.randperm(64, generator=g)
    assert torch.equal(invariant_linear(x[perm], w, bias), whole[perm])
    # within float32 rounding of the exact product (bf16 outputs: one bf16 rounding more)
    want = reference_invariant_linear(x.float(), w.float(), bias)
    scale = float((x.float().abs() @ w.float().abs().t()).max())
    tol = 4 * k * 2.0**-24 * scale + (2.0**-8 * float(want.abs().max()) if xdtype != torch.float32
                                     else 0.0)  # fmt: skip
    assert float((whole.double() - want).abs().max()) <= tol


def test_leading_dims_and_no_bias() -> None:
    x, w = torch.randn(2, 3, 32), torch.randn(8, 32)
    y = invariant_linear(x, w, None)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y.view(6, 8), invariant_linear(x.view(6, 32), w, None))


def test_f_linear_depends_on_its_batch() -> None:
    """Why the mode needs its own kernel: some row of ``F.linear`` changes in its last bits
    with the rows beside it (BLAS picks GEMV for one row, GEMM blockings by M)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g)
    whole = F.linear(x, w)
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(64)])
    assert not torch.equal(whole, alone)


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_env_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
    assert batch_invariant_from_env() is on
