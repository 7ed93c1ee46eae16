"""Native MoE decoders (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) through the whole engine:
greedy tokens equal transformers' ``generate`` (float32) with chunked prefills, forced
preemption and prefix-cache hits in one run (KV integrity checked every step), and with
n-gram speculative decoding; bf16 with the fused C++ ops gives the plain path's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.moe import MoEForCausalLM
from kvserve.moe.experts import FusedExperts
from tests.engine.test_native_families import SHARED, Native
from tests.engine.utils import random_prompts, run_engine_checked
from tests.model.tiny_moe import MOE_ARCHS, WINDOW, make_moe_model

MAX_TOKENS = 8
PROMPTS = SHARED[:2] + random_prompts([3, 20], seed=2)  # SHARED: a 29-token prefix + 5 / 11


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Native]:
    out = {}
    for arch in MOE_ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = Native(path, make_moe_model(arch, path))
    return out


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4, **kw))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers(moe: dict[str, Native], arch: str) -> None:
    """One prompt fills the prefix cache; then 4 prompts (2 sharing its 29-token prefix) run
    in 16 blocks of 4 with prefills chunked 8 tokens at a time: prefix-cache hits, preemptions
    and shared steps in one run, tokens equal to transformers'."""
    m = moe[arch]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    e = engine(m.path, num_kv_blocks=16, max_num_batched_tokens=8)
    assert isinstance(e.runner.model, MoEForCausalLM)
    assert run_engine_checked(e, PROMPTS[:1], params) == m.expected(PROMPTS[:1], MAX_TOKENS)
    assert e.stats()["prefix_cache_hits"] == 0
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > WINDOW  # Mixtral's window drops keys
    assert run_engine_checked(e, PROMPTS, params) == m.expected(PROMPTS, MAX_TOKENS)
    stats = e.stats()
    assert stats["prefix_cache_hits"] >= 7 * 4 * 2
    assert stats["num_preemptions"] > 0 and stats["max_num_running"] > 1
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 16


def test_ngram_speculative_decoding(moe: dict[str, Native]) -> None:
    """Verification rows (several queries per request) go through the experts too."""
    m = moe["qwen3_moe"]
    prompts = [PROMPTS[3][:9] * 3, *PROMPTS[:2]]  # the first repeats itself: n-gram matches
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    e = engine(m.path, num_kv_blocks=100, speculative_config=spec)
    assert run_engine_checked(e, prompts, params) == m.expected(prompts, MAX_TOKENS)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_bf16_fused_ops_keep_outputs(moe: dict[str, Native], arch: str) -> None:
    """bf16 with the fused C++ ops (norms, SiLU*up in the shared expert, the routed experts
    as one C++ call per layer, RoPE + KV write after OLMoE's whole-projection norms) gives the
    PyTorch chain's tokens."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for fused in (False, True):
        llm = LLM(str(moe[arch].path), dtype="bfloat16", num_kv_blocks=128, fused_ops=fused)
        model = llm.engine.runner.model
        assert model.norm.fused == fused and (model.decode_loop is not None) == fused
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        assert experts and all((m.kernel() is not None) == fused for m in experts)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert model.embed_tokens.weight.dtype == torch.bfloat16
