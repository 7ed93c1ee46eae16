"""int8/int4 MoE experts (round-to-nearest at load, on the quantized linear kernels): through
the engine, under preemption with KV integrity checked, a quantized Qwen2-MoE (dense layer,
routed experts, shared expert) gives exactly the tokens of the same model with every
quantized weight replaced by its dequantized value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import SamplingParams
from kvserve.config import Quantization
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.moe.experts import FusedExperts
from kvserve.quantization.apply import rtn_weight
from kvserve.quantization.qlinear import QuantLinear
from tests.engine.utils import PROJ, random_prompts, run_engine_checked
from tests.model.tiny_moe import make_moe_model

PROMPTS = random_prompts([5, 9, 14, 3])
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2_moe")
    make_moe_model("qwen2_moe", path)
    return path


def dequantized_copy(src: Path, dst: Path, method: Quantization) -> int:
    """``src`` with each projection (attention, dense MLP, shared expert, every expert's)
    rounded to nearest and dequantized, as the loader quantizes them (RTN works row by row,
    so each part of a fused q/k/v or gate/up rounds the same alone); returns how many."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state, n = load_file(str(src / "model.safetensors")), 0
    for name, t in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            state[name] = rtn_weight(t, method, None, name)[0].dequantize(torch.float32)
            n += 1
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return n


def run(path: Path, **kw: object) -> tuple[LLMEngine, dict[str, list[int]]]:
    cfg = build_engine_config(str(path), dtype="float32", block_size=4, num_kv_blocks=9, **kw)
    engine = LLMEngine(cfg)  # 9 blocks of 4 tokens for 4 requests of up to 26: preemption
    out = run_engine_checked(engine, PROMPTS, PARAMS)
    assert engine.stats()["num_preemptions"] > 0
    return engine, out


@pytest.mark.parametrize("method", [Quantization.INT8, Quantization.INT4])
def test_quantized_experts_equal_dequantized(
    qwen2_moe: Path, tmp_path: Path, method: Quantization
) -> None:
    # 2 x (qkv, o) + dense gate/up, down + shared gate/up, down + 4 experts x (gate/up, down)
    assert dequantized_copy(qwen2_moe, tmp_path / "dense", method) == 2 * 4 + 2 * 3 + 4 * 3
    engine, quantized = run(qwen2_moe, quantization=method.value)
    model = engine.runner.model
    experts = model.layers[1].mlp.experts
    assert isinstance(experts, FusedExperts) and experts.q_gate_up is not None
    assert all(isinstance(m, QuantLinear) for m in [*experts.q_gate_up, *experts.q_down])
    assert experts.gate_up_proj.numel() == 0  # the dense stacked weights are freed
    assert experts.kernel() is not None  # the quantized experts ran as one C++ call per layer
    assert model.quant_report.layers == 4 + 2 + 2 + 4 * 2
    _, dense = run(tmp_path / "dense")
    assert quantized == dense
