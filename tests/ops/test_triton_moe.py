"""The Triton experts op (``kvserve/ops/triton/moe.py``) against the one-token-at-a-time
reference (``kvserve.moe.experts.reference_experts``), under Triton's interpreter on CPU CI
(tests/conftest.py sets ``TRITON_INTERPRET=1``) or on CUDA where there is one: the pairs'
layout exactly, skewed routings (every token to one expert across several blocks, experts
with no token, a token's k slots on one expert), biases and gpt-oss's activation, tails of K
and N, and ``FusedExperts`` switched to it."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from kvserve.moe.experts import (
    FusedExperts,
    clamped_swiglu_and_mul,
    grouped_experts,
    reference_experts,
    silu_and_mul,
)
from kvserve.ops.triton import moe as triton_moe

E, H, I = 5, 36, 24  # noqa: E741  # K tails: H over blocks of 32; N 2I = 48 under 64


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_align_pairs_layout() -> None:
    """Pairs by expert, token order within, each run padded to whole blocks of 4; blocks past
    the last expert's run are -1; the padding slots hold the pair count (6)."""
    ids = torch.tensor([[1, 0], [1, 2], [0, 1]])  # pairs 0..5 = (t0,1) (t0,0) (t1,1) ...
    sorted_pairs, block_expert = triton_moe.align_pairs(ids, 4, block_m=4)
    # expert 0: pairs 1, 4; expert 1: 0, 2, 5; expert 2: 3; expert 3: none
    pad = 6
    want = [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 8
    assert sorted_pairs.tolist() == want  # 5 blocks: 6 pairs + 3 experts' padding at most
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


def _routing(kind: str, t: int, k: int, g: torch.Generator) -> torch.Tensor:
    if kind == "one-expert":  # every token's slots on experts 3 and 0: 2+ blocks of 16 rows
        return torch.tensor([[3, 0][:k]] * t)
    if kind == "same-expert-twice":  # a token's k slots on one expert
        return torch.full((t, k), 2)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])  # random


@pytest.mark.parametrize("kind", ["random", "one-expert", "same-expert-twice"])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        (torch.float32, 1e-5),
        (torch.float16, 2e-2),
        pytest.param(torch.bfloat16, 5e-2, marks=pytest.mark.cuda),
    ],
    ids=["fp32", "fp16", "bf16"],
)
def test_fused_experts_equals_reference(kind: str, dtype: torch.dtype, tol: float) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("no CUDA device (Triton's interpreter has no bf16 dot)")
    dev, g = _device(), torch.Generator().manual_seed(0)
    t, k = (37, 2) if kind == "one-expert" else (6, 2)
    x = torch.randn(t, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.2  # [E, 2I, H]
    down = torch.randn(E, H, I, generator=g) * 0.2  # [E, H, I]
    ids = _routing(kind, t, k, g)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    cast = [v.to(dtype) for v in (x, gate_up, down, weights)]
    ref = reference_experts(*[v.double() for v in cast[:3]], cast[3].double(), ids)
    out = triton_moe.fused_experts(*[v.to(dev) for v in cast[:3]], cast[3].to(dev),
                                   ids.to(dev), silu_and_mul)  # fmt: skip
    assert out.dtype == dtype and out.shape == (t, H)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol)


def test_biases_and_gpt_oss_activation() -> None:
    """gpt-oss's experts: biases on both projections, the clamped SwiGLU between them."""
    dev, g = _device(), torch.Generator().manual_seed(1)
    t, k = 9, 3
    x = torch.randn(t, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.3
    down = torch.randn(E, H, I, generator=g) * 0.3
    gb, db = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    act = functools.partial(clamped_swiglu_and_mul, alpha=1.702, limit=7.0)
    ref = reference_experts(x.double(), gate_up.double(), down.double(), weights.double(), ids,
                            act, gb.double(), db.double())  # fmt: skip
    out = triton_moe.fused_experts(x.to(dev), gate_up.to(dev), down.to(dev), weights.to(dev),
                                   ids.to(dev), act, gb.to(dev), db.to(dev))  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_no_tokens() -> None:
    x = torch.empty(0, H)
    out = triton_moe.fused_experts(x, torch.zeros(E, 2 * I, H), torch.zeros(E, H, I),
                                   torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long),
                                   silu_and_mul)  # fmt: skip
    assert out.shape == (0, H)


def test_fused_experts_module_on_triton() -> None:
    """``FusedExperts`` with ``use_triton`` (what ``enable_fused_ops`` sets on CUDA) gives the
    grouped PyTorch path's output."""
    dev, g = _device(), torch.Generator().manual_seed(2)
    layer = FusedExperts(E, H, I).to(dev)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) * 0.2)
        layer.down_proj.copy_(torch.randn(E, H, I, generator=g) * 0.2)
    t, k = 11, 2
    x = torch.randn(t, H, generator=g).to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]).to(dev)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
    with torch.no_grad():
        want = grouped_experts(x, layer.gate_up_proj, layer.down_proj, weights, ids)
        layer.use_triton = True
        got = layer(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
