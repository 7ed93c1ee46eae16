"""The grouped experts path equals the one-token-at-a-time reference on skewed routings
(every token to one expert, experts with no tokens, tied router scores, 1 token, many
tokens), in float32 and bf16; the routers match transformers' formulas."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvserve.moe.experts import FusedExperts, grouped_experts, reference_experts
from kvserve.moe.router import RouterConfig, Scoring, route
from kvserve.ops import cpu_kernels

E, H, INTER = 8, 64, 32


def experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) * 0.2).to(dtype)
    return gate_up, down


def tokens(t: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fixed_routing(ids: list[list[int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Given expert ids ``[T, k]`` with random positive weights summing to 1 per token."""
    idx = torch.tensor(ids)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(2)) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(dtype), idx


TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]


def check(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **kw: object) -> None:
    gate_up, down = experts(x.dtype)
    got = grouped_experts(x, gate_up, down, weights, ids, **kw)  # type: ignore[arg-type]
    want = reference_experts(x, gate_up, down, weights, ids, **kw)  # type: ignore[arg-type]
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[x.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_to_one_expert(dtype: torch.dtype) -> None:
    """k = 1, every token on expert 5: one matmul over all rows, seven experts idle."""
    check(tokens(17, dtype), *fixed_routing([[5]] * 17, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_without_tokens(dtype: torch.dtype) -> None:
    """k = 2 over experts 0, 3 and 7 only, in every order, the same expert twice per token
    never (top-k ids are distinct)."""
    ids = [[0, 3], [3, 0], [7, 0], [3, 7], [7, 3], [0, 7]] * 3
    check(tokens(len(ids), dtype), *fixed_routing(ids, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 128])
def test_routed_tokens(dtype: torch.dtype, t: int) -> None:
    """Router output for 1 and 128 tokens (k = 3, renormalised; every expert busy at 128)."""
    x = tokens(t, dtype)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    cfg = RouterConfig(E, 3, norm_topk_prob=True)
    weights, ids = route(F.linear(x, router), cfg)
    assert weights.dtype == dtype and ids.shape == (t, 3)
    assert t == 1 or ids.unique().numel() == E
    check(x, weights, ids)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_scores(dtype: torch.dtype) -> None:
    """Equal router logits: top-k still picks k distinct experts, each weighted 1/k."""
    x = tokens(6, dtype)
    weights, ids = route(torch.zeros(6, E, dtype=dtype), RouterConfig(E, 4, norm_topk_prob=True))
    assert all(len(set(row)) == 4 for row in ids.tolist())
    torch.testing.assert_close(weights.float(), torch.full((6, 4), 0.25))
    check(x, weights, ids)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ kernels")
def test_fused_activation() -> None:
    """The C++ SiLU*up kernel in the grouped path gives the PyTorch chain's numbers."""
    x = tokens(40, torch.bfloat16)
    weights, ids = route(torch.randn(40, E).bfloat16(), RouterConfig(E, 2))
    gate_up, down = experts(torch.bfloat16)
    fused = grouped_experts(x, gate_up, down, weights, ids, cpu_kernels.silu_and_mul)
    assert torch.equal(fused, grouped_experts(x, gate_up, down, weights, ids))


def test_float32_weights_scale_in_float32() -> None:
    """Mixtral keeps its routing weights in float32: bf16 outputs are scaled in float32 and
    rounded once, as transformers does, not scaled by a bf16-rounded weight."""
    x = tokens(30, torch.bfloat16)
    logits = torch.randn(30, E).bfloat16()
    w32, ids = route(logits, RouterConfig(E, 2, norm_topk_prob=True, float32_weights=True))
    assert w32.dtype == torch.float32
    gate_up, down = experts(torch.bfloat16)
    got = grouped_experts(x, gate_up, down, w32, ids)
    assert torch.equal(got, reference_experts(x, gate_up, down, w32, ids))
    assert not torch.equal(got, grouped_experts(x, gate_up, down, w32.bfloat16(), ids))


def test_router_formulas() -> None:
    """Softmax -> top-k (Qwen, OLMoE) with and without renormalisation, and Mixtral's
    top-k -> softmax, which equals softmax -> top-k -> renormalise within float32 rounding."""
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(logits, -1)
    top, top_ids = probs.topk(2, -1)
    w, ids = route(logits, RouterConfig(E, 2))
    assert torch.equal(ids, top_ids) and torch.equal(w, top)
    w, _ = route(logits, RouterConfig(E, 2, norm_topk_prob=True))
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))
    w_ts, ids_ts = route(logits, RouterConfig(E, 2, scoring=Scoring.TOPK_SOFTMAX))
    assert torch.equal(ids_ts, top_ids)
    torch.testing.assert_close(w_ts, w, atol=1e-6, rtol=1e-6)


def test_bad_router_config() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=4\]"):
        RouterConfig(4, 5)


def test_load_expert_checks_shapes() -> None:
    layer = FusedExperts(E, H, INTER)
    layer.load_expert(2, "up", torch.ones(INTER, H))
    assert torch.equal(layer.gate_up_proj[2, INTER:], torch.ones(INTER, H))
    with pytest.raises(ValueError, match=r"expert 2 down weight has shape \(32, 64\)"):
        layer.load_expert(2, "down", torch.ones(INTER, H))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        layer.load_expert(8, "gate", torch.ones(INTER, H))
