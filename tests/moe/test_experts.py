"""The grouped experts path equals the one-token-at-a-time reference on skewed routings
(every token to one expert, experts with no tokens, tied router scores, 1 token, many
tokens), in float32 and bf16; the routers match transformers' formulas; gpt-oss's biased,
clamped-SwiGLU experts and its router equal transformers' modules."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from kvserve.model.gpt_oss import load_stacked_experts
from kvserve.moe.experts import (
    FusedExperts,
    GluActivation,
    GluKind,
    act_and_mul_for,
    clamped_swiglu_and_mul,
    grouped_experts,
    reference_experts,
    silu_and_mul,
)
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
    # ATen's own bf16 matmul, not oneDNN's: on an AVX512-BF16 CPU oneDNN sums one row (the
    # reference's per-token calls) in another order than many (the grouped calls), and the
    # bf16 results differed in 2 runs of 10 there; with ATen's they agreed in 12 of 12.
    with torch.backends.mkldnn.flags(enabled=False):
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
    # a matrix kept quantized elsewhere (a GGUF's blocks) comes as a meta tensor: checked, not
    # copied (the stacked weight's pages stay untouched)
    layer.load_expert(2, "gate", torch.empty(INTER, H, device="meta"))
    assert torch.equal(layer.gate_up_proj[2, INTER:], torch.ones(INTER, H))
    with pytest.raises(ValueError, match="expert 1 gate weight has shape"):
        layer.load_expert(1, "gate", torch.empty(H, H, device="meta"))


def test_set_quantized_frees_the_dense_weights() -> None:
    """The loader's parameter dict still holds the stacked weights when a layer's experts are
    quantized: they are emptied in place, so that dict keeps no layer's dense experts."""
    layer = FusedExperts(E, H, INTER)
    held = dict(layer.named_parameters())
    experts = [torch.nn.Identity() for _ in range(E)]
    layer.set_quantized(list(experts), list(experts))
    assert held["gate_up_proj"] is layer.gate_up_proj and held["down_proj"] is layer.down_proj
    assert held["gate_up_proj"].numel() == held["down_proj"].numel() == 0
    assert held["gate_up_proj"].untyped_storage().nbytes() == 0


def gpt_oss_experts(limit: float) -> tuple[GptOssExperts, FusedExperts]:
    """transformers' ``GptOssExperts`` (random weights and biases, ``swiglu_limit``) and
    kvserve's ``FusedExperts`` loaded from its parameters as a checkpoint holds them."""
    cfg = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                       swiglu_limit=limit)  # fmt: skip
    torch.manual_seed(6)
    hf = GptOssExperts(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = FusedExperts(E, H, INTER, bias=True)
    ours.act_and_mul = act_and_mul_for(GluActivation(GluKind.CLAMPED_SWIGLU, 1.702, limit))
    for name, p in hf.named_parameters():
        load_stacked_experts(ours, name, p.detach())
    return hf, ours


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_gpt_oss_experts_equal_transformers(limit: float) -> None:
    """gpt-oss's biased experts with the clamped SwiGLU, from the checkpoint's interleaved
    layout, give transformers' ``GptOssExperts`` output for its router's choices (top-4 of
    the logits, softmax over the 4); a limit of 0.5 clamps most gates and ups."""
    hf, ours = gpt_oss_experts(limit)
    x = tokens(33, torch.float32)
    router = GptOssTopKRouter(GptOssConfig(hidden_size=H, num_local_experts=E,
                                           num_experts_per_tok=4))  # fmt: skip
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H) * 0.5)
        router.bias.copy_(torch.randn(E))
        _, hf_w, hf_ids = router(x)
        want = hf(x, hf_ids, hf_w)
        weights, ids = route(F.linear(x, router.weight, router.bias),
                             RouterConfig(E, 4, scoring=Scoring.TOPK_SOFTMAX))  # fmt: skip
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_w, atol=1e-7, rtol=1e-6)
        got = ours(x, weights, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        ours.use_reference = True
        torch.testing.assert_close(ours(x, weights, ids), want, atol=1e-5, rtol=1e-5)
    h = hf.gate_up_proj.detach()[0].T @ x[0]  # [2I] interleaved, expert 0
    assert (h[::2] > limit).any() == (limit < 1)  # the small limit really clamps


@pytest.mark.parametrize("dtype", DTYPES)
def test_biased_clamped_experts_on_skewed_routing(dtype: torch.dtype) -> None:
    """Biases and the clamped SwiGLU in the grouped path equal the reference on the skewed
    routings (every token to one expert, idle experts)."""
    act = act_and_mul_for(GluActivation(GluKind.CLAMPED_SWIGLU, 1.702, 0.3))
    g = torch.Generator().manual_seed(9)
    bias = {"gate_up_bias": torch.randn(E, 2 * INTER, generator=g).to(dtype),
            "down_bias": torch.randn(E, H, generator=g).to(dtype)}  # fmt: skip
    check(tokens(17, dtype), *fixed_routing([[5]] * 17, dtype), act_and_mul=act, **bias)
    ids = [[0, 3], [3, 0], [7, 0], [3, 7]] * 3
    check(tokens(len(ids), dtype), *fixed_routing(ids, dtype), act_and_mul=act, **bias)


def test_clamped_swiglu_formula() -> None:
    """The policy's function on hand-picked values: gate clamped above only, up both ways."""
    gate_up = torch.tensor([[10.0, -10.0, 0.5, 10.0, -10.0, 0.5]])  # gate | up
    out = clamped_swiglu_and_mul(gate_up, 1.702, 7.0)
    gate = torch.tensor([7.0, -10.0, 0.5])
    want = (torch.tensor([7.0, -7.0, 0.5]) + 1) * gate * torch.sigmoid(gate * 1.702)
    torch.testing.assert_close(out[0], want)
    assert act_and_mul_for(GluActivation()) is silu_and_mul
