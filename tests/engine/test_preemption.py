"""A KV cache too small for the batch: every policy finishes every request, unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.config import KVPolicy, PreemptionMode
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import random_prompts, run_engine_checked

PROMPTS = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4, **kw))


@pytest.fixture(scope="module")
def roomy(tiny_llama: Path) -> dict[str, list[int]]:
    e = engine(tiny_llama, num_kv_blocks=200)
    out = run_engine_checked(e, PROMPTS, PARAMS)
    assert e.stats()["num_preemptions"] == 0
    return out


@pytest.mark.parametrize(
    ("policy", "mode"),
    [("preempt", "recompute"), ("preempt", "swap"), ("reserve", "recompute")],
)
def test_small_cache_same_outputs(
    tiny_llama: Path, roomy: dict[str, list[int]], policy: str, mode: str
) -> None:
    # 14 blocks x 4 tokens = 56 tokens, for 8 requests needing up to 50 tokens each.
    e = engine(tiny_llama, num_kv_blocks=14, kv_policy=policy, preemption_mode=mode)
    out = run_engine_checked(e, PROMPTS, PARAMS)
    assert out == roomy
    stats = e.stats()
    if KVPolicy(policy) is KVPolicy.RESERVE:
        assert stats["num_preemptions"] == 0
    else:
        assert stats["num_preemptions"] > 0
    if PreemptionMode(mode) is PreemptionMode.SWAP:
        assert e.kv.swap_pool is not None
        assert e.kv.swap_pool.num_free_blocks == e.kv.swap_pool.num_blocks
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 14
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0


def test_swap_space_full_falls_back_to_recompute(
    tiny_llama: Path, roomy: dict[str, list[int]]
) -> None:
    # Room for one swapped block only: most preemptions must recompute instead.
    e = engine(tiny_llama, num_kv_blocks=14, preemption_mode="swap", swap_space=1)
    assert e.kv.swap_pool is None  # 1 byte holds no block
    assert run_engine_checked(e, PROMPTS, PARAMS) == roomy
    assert e.stats()["num_preemptions"] > 0


def test_reserve_admits_only_what_fits(tiny_llama: Path) -> None:
    """Each request reserves prompt + max_tokens: 20 + 30 tokens = 13 blocks of 4."""
    e = engine(tiny_llama, num_kv_blocks=14, kv_policy="reserve")
    for i, p in enumerate(random_prompts([20, 20])):
        e.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["0"]
    assert e.kv.block_ids("0") == list(range(13))
    assert len(e.scheduler.waiting) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_on_cuda_same_outputs(tiny_llama: Path) -> None:
    """Swap-out through pinned memory and swap-in queued on the stream (the runner's CUDA
    path) give the tokens of a cache that never preempts, on the GPU."""
    want = run_engine_checked(engine(tiny_llama, num_kv_blocks=200, device="cuda"), PROMPTS,
                              PARAMS)  # fmt: skip
    e = engine(tiny_llama, num_kv_blocks=14, preemption_mode="swap", device="cuda")
    assert run_engine_checked(e, PROMPTS, PARAMS) == want
    assert e.stats()["num_preemptions"] > 0
