"""Native gpt-oss through the whole engine (C++ decode kernel with sinks, the default on a
CPU): greedy tokens equal transformers' ``generate`` (float32) with chunked prefills, forced
preemption and prefix-cache hits in one run (KV integrity checked every step), and with n-gram
speculative decoding; int8/int4 experts give the tokens of their dequantized weights, and
MXFP4 experts kept as stored those of the checkpoint dequantized at load; bf16
with the fused C++ ops (decode steps in the C++ decode loop) gives the plain path's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.config import Quantization
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.gpt_oss import GptOssForCausalLM
from kvserve.ops import cpu_kernels
from kvserve.quantization.apply import rtn_weight
from tests.engine.test_moe_families import MAX_TOKENS, PROMPTS
from tests.engine.test_native_families import Native
from tests.engine.utils import run_engine_checked
from tests.model.test_gpt_oss import write_mxfp4
from tests.model.tiny_moe import GPT_OSS, WINDOW, make_moe_model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Native:
    path = tmp_path_factory.mktemp(GPT_OSS)
    return Native(path, make_moe_model(GPT_OSS, path))


def test_greedy_matches_transformers(gpt_oss: Native) -> None:
    """One prompt fills the prefix cache; then 4 prompts (2 sharing its 29-token prefix) run
    in 16 blocks of 4 with prefills chunked 8 tokens at a time: prefix-cache hits, preemptions
    and shared steps in one run, tokens equal to transformers'."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    config = build_engine_config(str(gpt_oss.path), dtype="float32", block_size=4,
                                 num_kv_blocks=16, max_num_batched_tokens=8)  # fmt: skip
    e = LLMEngine(config)
    assert isinstance(e.runner.model, GptOssForCausalLM)
    assert e.runner.attn_backend.name.value == "CPU_KERNEL"
    assert run_engine_checked(e, PROMPTS[:1], params) == gpt_oss.expected(PROMPTS[:1], MAX_TOKENS)
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > WINDOW  # layer 0's window drops keys
    assert run_engine_checked(e, PROMPTS, params) == gpt_oss.expected(PROMPTS, MAX_TOKENS)
    stats = e.stats()
    assert stats["prefix_cache_hits"] >= 7 * 4 * 2
    assert stats["num_preemptions"] > 0 and stats["max_num_running"] > 1
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 16


def test_ngram_speculative_decoding(gpt_oss: Native) -> None:
    """Verification rows (several queries per request) attend with the sinks and run the
    experts too: tokens equal transformers' with proposals accepted."""
    prompts = [PROMPTS[3][:9] * 3, *PROMPTS[:2]]  # the first repeats itself: n-gram matches
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = build_engine_config(str(gpt_oss.path), dtype="float32", block_size=4,
                                 num_kv_blocks=100, speculative_config=spec)  # fmt: skip
    e = LLMEngine(config)
    assert run_engine_checked(e, prompts, params) == gpt_oss.expected(prompts, MAX_TOKENS)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


def dequantized_copy(src: Path, dst: Path, method: Quantization) -> None:
    """``src`` with every projection (attention, each expert's gate/up and down) rounded to
    nearest and dequantized as the loader rounds them: per row of the ``[out, in]`` weight,
    which for the checkpoint's ``x @ W`` expert layout is per column (biases stay)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    for name, t in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            state[name] = rtn_weight(t, method, None, name)[0].dequantize(torch.float32)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = torch.stack([
                rtn_weight(w.T.contiguous(), method, None, name)[0].dequantize(torch.float32).T
                for w in t
            ])  # fmt: skip
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_quantized_experts_equal_dequantized(gpt_oss: Native, tmp_path: Path) -> None:
    """int4 experts (and attention; int8 takes the same path, tests/engine/test_moe_quant.py
    runs both kernels) give exactly the tokens of the same model with every
    quantized weight replaced by its dequantized value, under preemption; the expert biases
    stay in the model dtype, added after each quantized matmul."""
    method = Quantization.INT4
    dequantized_copy(gpt_oss.path, tmp_path / "dense", method)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for path, quant in ((gpt_oss.path, method.value), (tmp_path / "dense", None)):
        # products with the dequantized weights (auto: int8 for int4 on AVX2 without VNNI)
        config = build_engine_config(str(path), dtype="float32", block_size=4,
                                     num_kv_blocks=12, quantization=quant,
                                     quantization_activations="none")  # fmt: skip
        e = LLMEngine(config)
        outs.append(run_engine_checked(e, PROMPTS, params))
        assert e.stats()["num_preemptions"] > 0
        experts = e.runner.model.layers[1].mlp.experts
        assert (experts.q_gate_up is not None) == (quant is not None)
    assert experts.down_bias is not None
    assert outs[0] == outs[1]


def test_mxfp4_experts_kept_equal_dequantized(gpt_oss: Native, tmp_path: Path) -> None:
    """An MXFP4 checkpoint served with ``quantization="mxfp4"`` (the experts kept as stored,
    through the C++ experts op) gives the tokens of the same checkpoint dequantized at load,
    under preemption with KV checked every step."""
    write_mxfp4(gpt_oss.path, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for quant in ("mxfp4", None):
        config = build_engine_config(str(tmp_path), dtype="float32", block_size=4,
                                     num_kv_blocks=12, quantization=quant)  # fmt: skip
        e = LLMEngine(config)
        outs.append(run_engine_checked(e, PROMPTS, params))
        assert e.stats()["num_preemptions"] > 0
        experts = e.runner.model.layers[1].mlp.experts
        assert (experts.q_gate_up is not None) == (quant is not None)
        assert experts.use_kernel == cpu_kernels.available()
    assert outs[0] == outs[1]


def test_bf16_fused_ops_keep_outputs(gpt_oss: Native) -> None:
    """bf16 with the fused C++ ops (norms, RoPE + KV write after the biased q/k/v) gives the
    PyTorch chain's tokens, the experts (biases, clamped SwiGLU) as one C++ call per layer,
    decode steps in the C++ decode loop (sinks, the router and the experts op in it)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for fused in (False, True):
        llm = LLM(str(gpt_oss.path), dtype="bfloat16", num_kv_blocks=128, fused_ops=fused)
        model = llm.engine.runner.model
        assert model.norm.fused == fused and (model.decode_loop is not None) == fused
        assert (model.layers[0].mlp.experts.kernel() is not None) == fused
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert model.embed_tokens.weight.dtype == torch.bfloat16
