"""The C++ experts op (``csrc/moe_experts.cpp``) against the PyTorch grouped path and the
one-token reference, on the skewed routings of test_experts.py: dense float32 within 1e-5,
dense bf16 within bf16 rounding, int8/int4 ``QuantLinear`` experts equal to the grouped path
on the same layers bit for bit (float32 and bf16), biases and gpt-oss's clamped SwiGLU, odd
sizes, 1 and 2 threads; and ``FusedExperts``' switch to it with its fallback."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch.nn import functional as F

from kvserve.config import QuantizedActivations
from kvserve.moe import experts as experts_mod
from kvserve.moe.experts import (
    FusedExperts,
    GluActivation,
    GluKind,
    act_and_mul_for,
    grouped_experts,
    reference_experts,
)
from kvserve.moe.experts_kernel import experts_kernel
from kvserve.moe.router import RouterConfig, route
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import quantize_rtn

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ kernels")

E = 8
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
SILU = GluActivation()
CLAMPED = GluActivation(GluKind.CLAMPED_SWIGLU, 1.702, 0.3)  # a small limit: most clamp


def stacked(h: int, inter: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * inter, h, generator=g) * 0.2).to(dtype)  # [E, 2I, H]
    down = (torch.randn(E, h, inter, generator=g) * 0.2).to(dtype)  # [E, H, I]
    return gate_up, down


def biases(h: int, inter: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {"gate_up_bias": torch.randn(E, 2 * inter, generator=g).to(dtype),
            "down_bias": torch.randn(E, h, generator=g).to(dtype)}  # fmt: skip


def routings(t_many: int, h: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """(x [T, H], weights [T, k], ids [T, k]): every token to expert 5; experts 0, 3, 7 only;
    tied router scores (k = 4); one token and ``t_many`` tokens routed top-3."""

    def fixed(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids)
        w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(2)) + 0.1
        return (w / w.sum(-1, keepdim=True)).to(dtype), idx

    def x(t: int) -> torch.Tensor:
        return torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)

    router = torch.randn(E, h, generator=torch.Generator().manual_seed(4)).to(dtype)
    cfg = RouterConfig(E, 3, norm_topk_prob=True)
    out = [(x(17), *fixed([[5]] * 17)), (x(18), *fixed([[0, 3], [3, 0], [7, 0]] * 6))]
    out.append((x(6), *route(torch.zeros(6, E, dtype=dtype), RouterConfig(E, 4))))
    for t in (1, t_many):
        xt = x(t)
        out.append((xt, *route(F.linear(xt, router), cfg)))
    return out


def quantized(w: torch.Tensor, bits: int, dtype: torch.dtype) -> list[QuantLinear]:
    """Each expert's ``[N, K]`` matrix as a ``QuantLinear`` (int8 per channel, int4 g32)."""
    return [QuantLinear(quantize_rtn(w[e].float(), bits, None if bits == 8 else 32), None,
                        torch.device("cpu"), dtype) for e in range(E)]  # fmt: skip


def per_expert(layers: list[QuantLinear]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    return lambda e, rows: layers[e](rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [SILU, CLAMPED], ids=["silu", "clamped"])
def test_dense_experts(dtype: torch.dtype, act: GluActivation) -> None:
    """Dense experts of odd sizes (H 37, I 19: no vector divides them), with biases for the
    clamped SwiGLU: the op within float32 (bf16) rounding of the grouped path and the
    reference on every routing."""
    h, inter = 37, 19
    gate_up, down = stacked(h, inter, dtype)
    bias = biases(h, inter, dtype) if act is CLAMPED else {}
    op = experts_kernel(gate_up, down, act, bias.get("gate_up_bias"), bias.get("down_bias"))
    fn = act_and_mul_for(act)
    for x, w, ids in routings(128, h, dtype):
        got = op.run(x, w, ids)
        assert got.dtype == dtype and got.shape == x.shape
        want = grouped_experts(x, gate_up, down, w, ids, fn, **bias)
        torch.testing.assert_close(got, want, **TOL[dtype])
        if x.shape[0] < 128:  # test_experts.py holds grouped_experts to it at 128 tokens
            ref = reference_experts(x, gate_up, down, w, ids, fn, **bias)
            torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_equal_grouped(dtype: torch.dtype, bits: int) -> None:
    """int8 / int4 experts (H 96, I 64): the op runs the very kernel calls the grouped path
    makes through the same ``QuantLinear``s, so every number is equal; with 1 thread as
    with 2 (the op runs experts side by side or one at a time by their share of rows)."""
    h, inter = 96, 64
    gate_up, down = stacked(h, inter, torch.float32, seed=3)
    q_gate_up, q_down = quantized(gate_up, bits, dtype), quantized(down, bits, dtype)
    op = experts_kernel(q_gate_up, q_down, SILU)
    threads = torch.get_num_threads()
    for x, w, ids in routings(128, h, dtype):
        want = grouped_experts(x, per_expert(q_gate_up), per_expert(q_down), w, ids,
                               cpu_kernels.silu_and_mul)  # fmt: skip
        assert torch.equal(op.run(x, w, ids), want)
        torch.set_num_threads(1)
        try:
            assert torch.equal(op.run(x, w, ids), want)
        finally:
            torch.set_num_threads(threads)


def test_quantized_biased_clamped_bf16() -> None:
    """gpt-oss's int4 experts in bf16: biases added to each quantized product in bf16 and the
    clamped SwiGLU as the PyTorch chain computes it, equal bit for bit; Mixtral's float32
    routing weights scale the bf16 outputs in float32 as the grouped path does."""
    h, inter = 64, 32
    gate_up, down = stacked(h, inter, torch.float32, seed=5)
    q_gate_up = quantized(gate_up, 4, torch.bfloat16)
    q_down = quantized(down, 4, torch.bfloat16)
    bias = biases(h, inter, torch.bfloat16)
    op = experts_kernel(q_gate_up, q_down, CLAMPED, bias["gate_up_bias"], bias["down_bias"])
    for x, w, ids in routings(40, h, torch.bfloat16):
        for weights in (w, w.float()):
            want = grouped_experts(x, per_expert(q_gate_up), per_expert(q_down), weights, ids,
                                   act_and_mul_for(CLAMPED), **bias)  # fmt: skip
            assert torch.equal(op.run(x, weights, ids), want)


def test_gelu_tanh_experts() -> None:
    """GELU-tanh experts (hidden_act gelu_pytorch_tanh) through the C++ GeGLU kernel."""
    gate_up, down = stacked(32, 16, torch.float32)
    act = GluActivation(GluKind.GELU_TANH)
    op = experts_kernel(gate_up, down, act)
    for x, w, ids in routings(20, 32, torch.float32):
        want = reference_experts(x, gate_up, down, w, ids, act_and_mul_for(act))
        torch.testing.assert_close(op.run(x, w, ids), want, **TOL[torch.float32])


def test_bad_expert_id() -> None:
    gate_up, down = stacked(16, 16, torch.float32)
    op = experts_kernel(gate_up, down, SILU)
    with pytest.raises(RuntimeError, match="expert id 8 out of range: the layer has 8"):
        op.run(torch.ones(2, 16), torch.ones(2, 1), torch.tensor([[1], [8]]))


def test_fused_experts_switch(caplog: pytest.LogCaptureFixture) -> None:
    """``use_kernel`` (what enable_fused_ops sets on the CPU) runs the op, equal to the
    PyTorch path within float32 rounding; experts it cannot run (an activation it does not
    know, an int8-activation layer on the reference path) keep the PyTorch path, the reason
    logged once."""
    h, inter = 32, 16
    layer = FusedExperts(E, h, inter)
    gate_up, down = stacked(h, inter, torch.float32)
    layer.load_stacked("gate_up_proj", gate_up)
    layer.load_stacked("down_proj", down)
    x, w, ids = routings(9, h, torch.float32)[-1]
    with torch.no_grad():
        want = layer(x, w, ids)
        layer.use_kernel = True
        torch.testing.assert_close(layer(x, w, ids), want, **TOL[torch.float32])
        assert layer.kernel() is not None
        experts_mod._logged.clear()
        layer._kernel, layer.glu = None, None
        with caplog.at_level(logging.INFO, logger="kvserve.moe.experts"):
            assert torch.equal(layer(x, w, ids), want) and not layer.use_kernel
            layer.use_kernel = True
            layer(x, w, ids)
        msgs = [r.getMessage() for r in caplog.records if "C++ op cannot run" in r.getMessage()]
        assert msgs == ["MoE experts on the PyTorch grouped path: the C++ op cannot run an "
                        "activation it does not implement"]  # fmt: skip
    ref_layer = QuantLinear(quantize_rtn(gate_up[0], 8, None), None, torch.device("cpu"),
                            torch.float32, QuantizedActivations.NONE)  # fmt: skip
    ref_layer.path = "reference"
    with pytest.raises(ValueError, match="reference path"):
        experts_kernel([ref_layer] * E, quantized(down, 8, torch.float32), SILU)


def test_bf16_stacks_are_packed_once_and_freed() -> None:
    """bf16 experts under the op run from weights packed for ``wide_linear_packed``, which
    become the only copy (the stacks are emptied); the op's output is the ``[N, K]`` op's
    within float32 summation order, and the PyTorch paths over the packed weights (the
    reference switch) give the stacks' numbers bit for bit. Odd sizes: N not a multiple of 16."""
    h, inter = 40, 24  # gate_up N = 48, down N = 40: a partial strip
    gate_up, down = stacked(h, inter, torch.bfloat16, seed=3)
    layer = FusedExperts(E, h, inter).to(torch.bfloat16)
    layer.load_stacked("gate_up_proj", gate_up)
    layer.load_stacked("down_proj", down)
    with torch.no_grad():
        plain = experts_kernel(gate_up, down, SILU)  # the [N, K] path
        layer.use_kernel = True
        for x, w, ids in routings(21, h, torch.bfloat16):
            got = layer(x, w, ids)
            assert layer.gate_up_proj.numel() == layer.down_proj.numel() == 0
            assert layer.gate_up_packed is not None and layer.down_packed is not None
            assert tuple(layer.gate_up_packed.shape) == (E, 3, h, 16)
            assert tuple(layer.down_packed.shape) == (E, 3, inter, 16)
            torch.testing.assert_close(got, plain.run(x, w, ids), atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(got, grouped_experts(x, gate_up, down, w, ids),
                                       **TOL[torch.bfloat16])  # fmt: skip
            layer.use_reference = True
            assert torch.equal(layer(x, w, ids), reference_experts(x, gate_up, down, w, ids))
            layer.use_reference = False
