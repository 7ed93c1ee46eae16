"""TP=2 shards MoE experts like the dense MLP (each rank a slice of every expert, the router
replicated): a Qwen2-MoE (dense layer, shared expert, routed experts, q/k/v bias) gives TP=1's
float32 logits and greedy tokens over a prefill and decode steps, and so does gpt-oss (sinks,
biased experts); OLMoE is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.distributed.parallel_state import TPGroup
from kvserve.model.moe import MoEForCausalLM
from kvserve.moe.experts import FusedExperts
from tests.distributed.scripts import Script
from tests.distributed.test_llama_tp import DECODE_STEPS, PROMPTS, check_against_tp1
from tests.model.tiny_moe import GPT_OSS, make_moe_model, moe_config


# rank r of 2 as a constructor sees it: no collective runs in these unit tests
def rank_of_two(rank: int) -> TPGroup:
    return TPGroup(rank=rank, world_size=2, group=object())  # type: ignore[arg-type]


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    make_moe_model("qwen2_moe", tmp_path)
    script = Script(PROMPTS, DECODE_STEPS, use_kernel=False)
    assert check_against_tp1(tmp_path, [script], 2) == [1, 1]


def test_gpt_oss_tp2_equals_tp1(tmp_path: Path) -> None:
    """gpt-oss at TP=2: each rank's slice of the sinks (its heads), of the q/k/v biases and
    of every expert with its gate/up bias; the down bias added by rank 0 only; the biased
    router replicated. Decode through SDPA and through the C++ kernel's sinks."""
    make_moe_model(GPT_OSS, tmp_path)
    scripts = [Script(PROMPTS, DECODE_STEPS, use_kernel=False),
               Script(PROMPTS, DECODE_STEPS, use_kernel=True)]  # fmt: skip
    assert check_against_tp1(tmp_path, scripts, 2) == [1, 1]


def test_expert_slices() -> None:
    """Rank 1 of 2 holds rows 16..31 of each gate and up, columns 16..31 of each down."""
    experts = FusedExperts(4, 8, 32, rank_of_two(1))
    gate, up, down = torch.randn(32, 8), torch.randn(32, 8), torch.randn(8, 32)
    experts.load_expert(3, "gate", gate)
    experts.load_expert(3, "up", up)
    experts.load_expert(3, "down", down)
    assert torch.equal(experts.gate_up_proj[3], torch.cat([gate[16:], up[16:]]))
    assert torch.equal(experts.down_proj[3], down[:, 16:])


def test_olmoe_refused() -> None:
    cfg = moe_config("olmoe", architectures=["OlmoeForCausalLM"])
    with pytest.raises(ValueError, match="OlmoeForCausalLM does not support tensor parallel"):
        MoEForCausalLM(cfg, 64, tp=rank_of_two(0))
