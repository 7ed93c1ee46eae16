"""MoE classes through the transformers backend (its attention on kvserve's paged KV cache,
the experts in transformers' code): Qwen3-MoE and gpt-oss (its attention sinks) forced onto it
and GraniteMoE (no native class) give transformers' greedy tokens under preemption;
DeepSeek-V2/V3 (MLA, group-limited routing) are refused by name, whatever the model_impl, and
quantizing a backend MoE too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvserve import SamplingParams
from kvserve.config import ModelImpl, Quantization
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model
from kvserve.model.registry import resolve_model_class
from kvserve.model.transformers_backend import TransformersForCausalLM
from kvserve.quantization.apply import QuantOptions
from tests.engine.test_native_families import Native
from tests.engine.utils import random_prompts, run_engine_checked
from tests.model.tiny_hf import COMMON, save_model
from tests.model.tiny_moe import GPT_OSS, make_moe_model

PROMPTS = random_prompts([5, 12, 20, 9])
MAX_TOKENS = 8
DEEPSEEK = {
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "first_k_dense_replace": 1, "num_key_value_heads": 4,
}  # fmt: skip


@pytest.fixture(scope="module")
def backend_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Native, str]]:
    """name -> (model folder and its transformers twin, the model_impl to load it with)."""
    qwen = tmp_path_factory.mktemp("qwen3_moe")
    granite = tmp_path_factory.mktemp("granitemoe")
    gpt_oss = tmp_path_factory.mktemp("gpt_oss")
    cfg = transformers.GraniteMoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return {
        "qwen3_moe": (Native(qwen, make_moe_model("qwen3_moe", qwen)), "transformers"),
        "granitemoe": (Native(granite, save_model(cfg, granite)), "auto"),
        # the attention sinks reach kvserve's backend as ``sinks`` (s_aux in transformers)
        "gpt_oss": (Native(gpt_oss, make_moe_model(GPT_OSS, gpt_oss)), "transformers"),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "granitemoe", "gpt_oss"])
def test_backend_greedy_under_preemption(
    backend_moe: dict[str, tuple[Native, str]], name: str
) -> None:
    """8 blocks of 4 tokens for 4 requests needing up to 7 each: preemptions, KV checked."""
    m, impl = backend_moe[name]
    cfg = build_engine_config(str(m.path), dtype="float32", block_size=4, num_kv_blocks=8,
                              model_impl=impl)  # fmt: skip
    e = LLMEngine(cfg)
    assert isinstance(e.runner.model, TransformersForCausalLM)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run_engine_checked(e, PROMPTS, params) == m.expected(PROMPTS, MAX_TOKENS)
    assert e.stats()["num_preemptions"] > 0


def test_backend_moe_quantization_refused(backend_moe: dict[str, tuple[Native, str]]) -> None:
    m, _ = backend_moe["granitemoe"]
    with pytest.raises(
        ValueError, match=r"GraniteMoeForCausalLM cannot be quantized \(int8\): its experts"
    ):
        load_model(m.path, torch.float32, "cpu", 64, quant=QuantOptions(Quantization.INT8))


@pytest.mark.parametrize("cls", ["DeepseekV2Config", "DeepseekV3Config"])
@pytest.mark.parametrize("impl", list(ModelImpl))
def test_deepseek_refused_by_name(cls: str, impl: ModelImpl, tmp_path: Path) -> None:
    """Refused from config.json alone, before any weight is read (there are none here)."""
    cfg = getattr(transformers, cls)(**{**COMMON, **DEEPSEEK})
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    model_type = cfg.model_type
    match = rf"{cfg.architectures[0]} \(model_type '{model_type}'\) is not supported: multi-head"
    with pytest.raises(ValueError, match=match):
        resolve_model_class(cfg, impl)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="group-limited routing"):
        load_model(tmp_path, torch.float32, "cpu", 64, model_impl=impl)
