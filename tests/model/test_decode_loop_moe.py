"""The C++ decode loop on mixture-of-experts layers (``kvserve/model/decode_loop.py``: the
router, the top-k routing and the layer's C++ experts op in ``csrc/decode_layers.cpp``) against
the Python layers: the same tokens and KV cache bytes through the whole engine for Qwen2-MoE
(a dense first layer, a gated shared expert beside the routed ones, q/k/v bias), Qwen3-MoE
(renormalised top-k, q/k norms), Mixtral (float32 routing weights, a window on every layer),
OLMoE (q/k norms over the whole projections, ``clip_qkv`` clamping) and gpt-oss (a biased
router, top-k then softmax, attention sinks, biased experts with the clamped SwiGLU,
alternating windows), with dense and quantized experts; the exact number of steps the loop
took; and what it refuses, by reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.model.decode_loop import build_decode_loop
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear
from tests.model.test_decode_loop import assert_loop_equals_eager, engine
from tests.model.tiny_moe import make_moe_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
WEIGHTS = {"bf16": {}, "int4": {"quantization": "int4"}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch in ARCHS:
        out[arch] = path = tmp_path_factory.mktemp(arch)
        make_moe_model(arch, path)
    return out


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_loop_equals_python_layers(models: dict[str, Path], arch: str, weights: str) -> None:
    quant = WEIGHTS[weights]

    def check(model: nn.Module) -> None:
        experts = model.layers[1].mlp.experts
        assert experts.kernel() is not None
        assert isinstance(experts.q_gate_up[0], QuantLinear) if quant else experts.q_gate_up is None
        assert (model.layers[0].self_attn.sinks is not None) == (arch == "gpt_oss")

    assert_loop_equals_eager(models[arch], quant, check)


def test_experts_not_on_the_op_keep_python(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    e = engine(models["qwen3_moe"])
    assert e.runner is not None
    model = e.runner.model
    for layer in model.layers:
        layer.mlp.experts.use_kernel = False
    assert build_decode_loop(model) is None
    assert "C++ decode loop off: layer 0's experts do not run as the C++ experts op" in caplog.text


def test_moe_layer_arguments_are_checked() -> None:
    layers = torch.classes.kvserve.DecodeLayers(4, 2, 16)
    w = torch.ones(64, dtype=torch.bfloat16)
    op = torch.classes.kvserve.MoEExperts(0, 1.0, 0.0)
    layers.set_moe(op, 2, False, True, False, False)
    for _ in range(4):
        layers.add_linear(3, w.view(1, 64), w, w, None, 1, 0, 0, 0, 0, 0, False)
    with pytest.raises(RuntimeError, match="a layer takes exactly 3 linears, got 4"):
        layers.add_layer(w, 1e-6, w, 1e-6, None, None, 1e-6, 0, 0.0, 0.25)
    with pytest.raises(RuntimeError, match="experts must be a MoEExperts op and top_k at least"):
        layers.set_moe(op, 0, False, True, False, False)
    layers.set_moe(op, 2, False, True, False, True)  # with a shared expert: 6 linears
    with pytest.raises(RuntimeError, match="a layer takes exactly 6 linears, got 4"):
        layers.add_layer(w, 1e-6, w, 1e-6, None, None, 1e-6, 0, 0.0, 0.25)
    with pytest.raises(RuntimeError, match="one float32 logit per query head of an added layer"):
        layers.set_sinks(0, torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"\[H \* D\] and \[Hkv \* D\] weights of an added"):
        layers.set_whole_qk_norm(0, torch.ones(64), torch.ones(32), 1e-6, None)
