"""Native Qwen3, Mistral (a window on every layer) and Gemma 1/2/3 (text) through the
whole engine: greedy outputs equal transformers' ``generate`` (float32, sliding windows
smaller than prompt + output), under forced preemption and with prefix caching (KV
integrity checked every step), and bf16 with the fused C++ ops and prepacked weights gives
the plain path's tokens."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve import LLM, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from tests.engine.utils import random_prompts, run_engine_checked
from tests.model.tiny_native import MISTRAL_WINDOW, NATIVE_ARCHS, WINDOW, make_native_model

LENGTHS = [3, 7, 12, 5, 20, 9, 1, 15, 33]
MAX_TOKENS = 12
SYSTEM = random_prompts([29], seed=9)[0]  # a shared prefix: 7 blocks of 4 and a bit
SHARED = [SYSTEM + t for t in random_prompts([5, 11, 1, 8], seed=10)]


class Native:
    """A tiny model folder and its transformers twin, with memoised reference outputs."""

    def __init__(self, path: Path, hf: PreTrainedModel) -> None:
        self.path = path
        self.hf = hf
        self.greedy = cache(self._greedy)

    def _greedy(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        """transformers' greedy tokens, EOS included: the engine runs with ignore_eos, and
        ``min_new_tokens`` (test_equivalence.hf_greedy) would mask EOS out instead (gemma3's
        request 3 emits EOS at its 28th token)."""
        out = self.hf.generate(  # type: ignore[operator]
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        tokens = out[0, len(prompt) :].tolist()
        assert len(tokens) == max_tokens
        return tokens

    def expected(self, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
        """run_engine_checked's result shape: request id (prompt index) -> tokens."""
        return {str(i): self.greedy(tuple(p), max_tokens) for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Native]:
    out = {}
    for arch in NATIVE_ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = Native(path, make_native_model(arch, path))
    return out


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4, **kw))


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
@pytest.mark.parametrize(
    ("block_size", "max_batched"),
    [(16, 2048), (4, 8)],  # the second chunks prefills and splits them across blocks
)
def test_greedy_matches_transformers(
    native: dict[str, Native], arch: str, block_size: int, max_batched: int
) -> None:
    m = native[arch]
    prompts = random_prompts(LENGTHS)
    assert max(LENGTHS) + MAX_TOKENS > max(WINDOW, MISTRAL_WINDOW)
    llm = LLM(
        str(m.path),
        dtype="float32",
        num_kv_blocks=128,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
    )
    # Windows are applied in attention, so the context is not capped at the window.
    assert llm.engine.max_model_len == 512
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == m.greedy(tuple(prompt), MAX_TOKENS)
    stats = llm.stats()
    assert stats["max_num_running"] > 1  # the prompts really shared steps
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption(native: dict[str, Native], arch: str, mode: str) -> None:
    """14 blocks of 4 tokens for 8 requests needing up to 50 tokens each."""
    m = native[arch]
    prompts = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    e = engine(m.path, num_kv_blocks=14, preemption_mode=mode)
    assert run_engine_checked(e, prompts, params) == m.expected(prompts, 30)
    stats = e.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 14


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_prefix_caching(native: dict[str, Native], arch: str) -> None:
    """Requests sharing a 29-token prefix (past every window) reuse its 7 full blocks."""
    m = native[arch]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    e = engine(m.path, num_kv_blocks=200)
    assert run_engine_checked(e, SHARED[:1], params) == m.expected(SHARED[:1], MAX_TOKENS)
    assert e.stats()["prefix_cache_hits"] == 0
    assert run_engine_checked(e, SHARED, params) == m.expected(SHARED, MAX_TOKENS)
    assert e.stats()["prefix_cache_hits"] >= 7 * 4 * len(SHARED)


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_preemption_over_cached_prefixes(native: dict[str, Native], arch: str) -> None:
    m = native[arch]
    prompts = SHARED + random_prompts([3, 20, 9], seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    e = engine(m.path, num_kv_blocks=30)
    assert run_engine_checked(e, prompts, params) == m.expected(prompts, 16)
    stats = e.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
def test_bf16_fast_paths_keep_outputs(native: dict[str, Native], arch: str) -> None:
    """bf16 with oneDNN-prepacked weights and the fused C++ ops (norms, GeGLU/SiLU, q/k norm
    + RoPE + KV write) gives the tokens of the plain nn.Linear + PyTorch op chain path."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for prepack, fused in ((False, False), (True, False), (True, True)):
        llm = LLM(
            str(native[arch].path),
            dtype="bfloat16",
            num_kv_blocks=128,
            prepack_weights=prepack,
            fused_ops=fused,
        )
        model = llm.engine.runner.model
        assert model.norm.fused == fused
        assert all(layer.self_attn.fused == fused for layer in model.layers)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]
    assert torch.bfloat16 == llm.engine.runner.model.embed_tokens.weight.dtype


def test_mistral_window_changes_outputs(native: dict[str, Native]) -> None:
    """The window the tests above match really bites: the same weights without a window
    give other greedy tokens for the longest prompt, so ignoring it could not pass."""
    m = native["mistral"]
    prompt = random_prompts(LENGTHS)[LENGTHS.index(max(LENGTHS))]
    m.hf.config.sliding_window = None
    try:
        full = m.hf.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )[0, len(prompt) :].tolist()  # fmt: skip
    finally:
        m.hf.config.sliding_window = MISTRAL_WINDOW
    assert full != m.greedy(tuple(prompt), MAX_TOKENS)
