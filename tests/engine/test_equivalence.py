"""Greedy outputs equal transformers' own ``generate`` on tiny random models (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.ops.packed_linear import packing_supported
from tests.engine.conftest import TinyModels
from tests.engine.utils import random_prompts

LENGTHS = [3, 7, 12, 5, 20, 9, 1, 15, 33]
MAX_TOKENS = 12


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    ("block_size", "max_batched"),
    [(16, 2048), (4, 8)],  # the second chunks prefills and splits them across blocks
)
@pytest.mark.parametrize(
    "backend",
    [
        "TORCH_SDPA",
        "CPU_KERNEL",
        # Triton's kernels serve a whole engine: on CUDA natively, elsewhere in Triton's
        # interpreter (tests/conftest.py sets TRITON_INTERPRET=1), ~15 s per case there, so
        # one architecture runs it off CUDA (the kernels' own tests cover the rest).
        "TRITON_ATTN",
    ],
)
def test_greedy_matches_transformers(
    tiny_models: TinyModels, arch: str, block_size: int, max_batched: int, backend: str
) -> None:
    if backend == "TRITON_ATTN" and arch != "llama" and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter: llama only (qwen2 and mistral pass too, 15 s each)")
    path, hf_model = tiny_models[arch]
    prompts = random_prompts(LENGTHS)
    llm = LLM(
        str(path),
        dtype="float32",
        num_kv_blocks=128,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
        attention_backend=backend,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.runner.attn_backend.name.value == backend
    stats = llm.stats()
    assert stats["max_num_running"] > 1  # the prompts really shared steps
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_eos_stops_like_transformers(tiny_models: TinyModels) -> None:
    """Without ignore_eos, a request ends at EOS with finish_reason 'stop'."""
    path, hf_model = tiny_models["llama"]
    # Make EOS likely: pick the token the model predicts first for some prompt as "EOS".
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompt = random_prompts([6], seed=3)[0]
    first = hf_greedy(hf_model, prompt, 3)
    llm.engine.eos_token_ids = [first[1]]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == first[:2]
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_fast_paths_keep_outputs(tiny_models: TinyModels, arch: str) -> None:
    """bf16 with oneDNN-prepacked weights and the fused C++ ops gives the tokens of the plain
    nn.Linear + PyTorch op chain path."""
    path, _ = tiny_models[arch]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for prepack, fused in ((False, False), (True, False), (True, True)):
        llm = LLM(
            str(path),
            dtype="bfloat16",
            num_kv_blocks=128,
            prepack_weights=prepack,
            fused_ops=fused,
        )
        assert llm.engine.runner.model.norm.fused == fused
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]


def test_warm_up_leaves_no_trace(tiny_llama: Path) -> None:
    """The dummy prefill at start-up runs whole 32-token rows into blocks 0.. without the
    block pool, and later requests generate exactly what they do without it."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for warmup in (False, True):
        llm = LLM(
            str(tiny_llama),
            dtype="bfloat16",
            num_kv_blocks=40,
            block_size=4,
            max_num_batched_tokens=100,
            warmup=warmup,
        )
        # The engine warms up only where weights are prepacked (not on AVX2-only CPUs).
        packs = packing_supported(torch.device("cpu"), torch.bfloat16)
        assert llm.engine.warmup_tokens == (96 if warmup and packs else 0)
        assert llm.stats()["num_free_kv_blocks"] == 40  # the pool never saw the dummy rows
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    runner = llm.engine.runner
    k_cache = runner.kv_caches[0][0]
    k_cache.zero_()
    # 100 tokens -> 3 rows of 32 (8 blocks of 4 each): blocks 0..23 written, 24.. untouched.
    assert runner.warm_up(100, max_len=2048) == 96
    written = k_cache.flatten(1).ne(0).any(dim=1)  # [num_blocks]
    assert written.nonzero().flatten().tolist() == list(range(24))
    # A short context limit shortens the rows; the KV cache caps the row count.
    assert runner.warm_up(100, max_len=6) == 96  # 16 rows of 6 tokens, 2 blocks each
    assert runner.warm_up(10_000, max_len=2048) == 5 * 32  # 40 blocks hold 5 rows
