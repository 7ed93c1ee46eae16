"""The transformers backend through the whole engine: greedy outputs equal transformers' own
``generate`` (float32, tiny random models) for every architecture of ``tiny_hf.CONFIGS``,
also under forced preemption and with prefix caching, KV integrity checked after every step."""

from __future__ import annotations

import argparse
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.config import ModelImpl
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.registry import NATIVE_ARCHITECTURES
from kvserve.model.transformers_backend import TransformersForCausalLM
from kvserve.spec.truncated_draft import write_truncated_draft
from tests.engine.utils import random_prompts, run_engine_checked
from tests.model.tiny_hf import CONFIGS, byte_tokenizer, make_tiny_hf_model

ARCHS = list(CONFIGS)
PROMPTS = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
SYSTEM = random_prompts([37], seed=9)[0]  # a shared "system prompt": 9 blocks of 4 and a bit
SHARED = [SYSTEM + t for t in random_prompts([5, 11, 1, 8, 3], seed=10)]
MAX_TOKENS = 12
# min_tokens masks EOS as generate's min_new_tokens does (ignore_eos would let the engine
# pick EOS where transformers may not).
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)

HFModels = dict[str, tuple[Path, PreTrainedModel]]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> HFModels:
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"hf-{arch}")
        out[arch] = (path, make_tiny_hf_model(arch, path))
    return out


_REFERENCE_MODELS: dict[str, PreTrainedModel] = {}


@cache
def hf_greedy(arch: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' own greedy continuation (its default attention, its own KV cache)."""
    model = _REFERENCE_MODELS[arch]
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def engine(hf_models: HFModels, arch: str, **kw: object) -> LLMEngine:
    path, model = hf_models[arch]
    _REFERENCE_MODELS[arch] = model
    # Architectures with a native class: force the backend; the others take it under "auto".
    native = model.config.architectures[0] in NATIVE_ARCHITECTURES
    impl = "transformers" if native else "auto"
    opts = {"dtype": "float32", "block_size": 4, "model_impl": impl, **kw}
    e = LLMEngine(build_engine_config(str(path), **opts))
    assert isinstance(e.runner.model, TransformersForCausalLM)
    return e


def expected(arch: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    return {str(i): hf_greedy(arch, tuple(p)) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(hf_models: HFModels, arch: str) -> None:
    """Chunked prefills (8 tokens a step) across blocks of 4, mixed with decode rows."""
    e = engine(hf_models, arch, num_kv_blocks=128, max_num_batched_tokens=8)
    assert run_engine_checked(e, PROMPTS, GREEDY) == expected(arch, PROMPTS)
    stats = e.stats()
    assert stats["max_num_running"] > 1  # the prompts really shared steps
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("arch", ARCHS)
def test_forced_preemption(hf_models: HFModels, arch: str) -> None:
    # 14 blocks x 4 tokens = 56 tokens, for 8 requests needing up to 32 tokens each.
    e = engine(hf_models, arch, num_kv_blocks=14)
    assert run_engine_checked(e, PROMPTS, GREEDY) == expected(arch, PROMPTS)
    assert e.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching(hf_models: HFModels, arch: str) -> None:
    e = engine(hf_models, arch, num_kv_blocks=200)
    first = run_engine_checked(e, SHARED[:1], GREEDY)
    assert first == expected(arch, SHARED[:1])
    # The rest share the first one's 9 system-prompt blocks (freed, still cached).
    assert run_engine_checked(e, SHARED, GREEDY) == expected(arch, SHARED)
    assert e.stats()["prefix_cache_hits"] >= 9 * 4 * len(SHARED)


def test_swap_preemption(hf_models: HFModels) -> None:
    e = engine(hf_models, "qwen3", num_kv_blocks=14, preemption_mode="swap")
    assert run_engine_checked(e, PROMPTS, GREEDY) == expected("qwen3", PROMPTS)
    assert e.stats()["num_preemptions"] > 0
    assert e.kv.swap_pool is not None


def test_sdpa_decode_backend(hf_models: HFModels) -> None:
    e = engine(hf_models, "gemma2", num_kv_blocks=128, attention_backend="TORCH_SDPA")
    assert isinstance(e.runner.attn_backend, TorchSDPABackend)
    assert run_engine_checked(e, PROMPTS, GREEDY) == expected("gemma2", PROMPTS)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding(
    hf_models: HFModels, tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    """Verification rows (and a one-layer draft of the target, itself on the backend) keep
    the greedy outputs."""
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(write_truncated_draft(hf_models["qwen3"][0],
                                                  tmp_path_factory.mktemp("draft"), 1))  # fmt: skip
    e = engine(hf_models, "qwen3", num_kv_blocks=128, speculative_config=spec)
    assert run_engine_checked(e, PROMPTS, GREEDY) == expected("qwen3", PROMPTS)
    assert e.stats()["spec_decode_num_draft_tokens"] > 0
    if method == "draft_model":
        assert isinstance(e.runner.proposer.model, TransformersForCausalLM)  # type: ignore[union-attr]


@pytest.mark.parametrize("arch", ["granite", "gemma2"])
def test_prompt_logprobs_and_embeddings(hf_models: HFModels, arch: str) -> None:
    """Prompt logprobs come from compute_logits (Granite's logits_scaling, Gemma 2's final
    soft-capping included); embeddings pool the body's final hidden states (after its norm)."""
    path, model = hf_models[arch]
    prompt = PROMPTS[4]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    with torch.no_grad():
        res = model(torch.tensor([prompt]), output_hidden_states=True)  # type: ignore[operator]
    ref = torch.log_softmax(res.logits[0].float(), dim=-1)  # [L, V]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        got = out.prompt_logprobs[p][prompt[p]].logprob
        assert got == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
    emb = llm.embed([{"prompt_token_ids": prompt}], use_tqdm=False)[0].outputs.embedding
    want = torch.nn.functional.normalize(res.hidden_states[-1][0, -1], dim=-1)
    assert torch.allclose(torch.tensor(emb), want, atol=2e-5)


def test_text_prompt_and_eos(hf_models: HFModels) -> None:
    """The folder's tokenizer and EOS id work as for a native model."""
    path, model = hf_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.eos_token_ids == [256]
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    ids = byte_tokenizer().encode("hello")
    assert out.prompt_token_ids == ids
    _REFERENCE_MODELS["qwen3"] = model
    assert out.outputs[0].token_ids == hf_greedy("qwen3", tuple(ids), 6)


def test_bf16_prepacked_keeps_outputs(hf_models: HFModels) -> None:
    """bf16 with every nn.Linear of transformers' modules prepacked by oneDNN gives the
    tokens of plain nn.Linear."""
    path, _ = hf_models["phi3"]
    kw = {"dtype": "bfloat16", "num_kv_blocks": 128, "warmup": False}
    outs = []
    for prepack in (False, True):
        llm = LLM(str(path), prepack_weights=prepack, **kw)
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in res])
    assert outs[0] == outs[1]


def test_model_impl_option(hf_models: HFModels) -> None:
    """--model-impl reaches the config; 'auto' keeps Llama native; a bad value is refused."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    path = str(hf_models["llama"][0])
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", path, "--model-impl", "kvserve"]))
    assert args.create_engine_config().model.model_impl is ModelImpl.KVSERVE
    llm = LLM(path, dtype="float32", num_kv_blocks=16)
    assert isinstance(llm.engine.runner.model, LlamaForCausalLM)
    with pytest.raises(ValueError, match=r"model_impl must be one of \['auto', 'kvserve', "):
        LLM(path, model_impl="vllm")
    phi3 = str(hf_models["phi3"][0])
    with pytest.raises(ValueError, match="model_impl='kvserve': Phi3ForCausalLM has no native"):
        LLM(phi3, dtype="float32", num_kv_blocks=16, model_impl="kvserve")
