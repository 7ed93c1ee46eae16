"""Adapters under tensor parallelism: each rank's slice (``kvserve/lora/sharding.py``) adds up
to the whole adapter's delta, and TP=2 serves a batch mixing four adapters and the base model
with the tokens of TP=1 and of peft's merged models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.distributed.layers import row_parallel_with
from kvserve.lora.peft_loader import LoRAAdapterError, LoRAModel
from kvserve.lora.sharding import SPLIT, LoRASplit, shard_lora_model, shard_pair
from tests.distributed.scripts import Script, load, lora_tokens, row_parallel_lora, run_script
from tests.distributed.utils import run_ranks
from tests.engine.utils import random_prompts
from tests.lora.utils import hf_greedy, merged_model


def whole_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x @ a.t() @ b.t()  # [T, out]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("module", sorted(SPLIT))
def test_rank_slices_add_up_to_the_whole_delta(module: str, world_size: int) -> None:
    """Column-parallel modules: the ranks' deltas side by side are the whole delta (each
    rank's own output features); row-parallel ones: the ranks' partial deltas of their
    input slices sum to it (what the layer's all-reduce does)."""
    torch.manual_seed(0)
    r, k, n = 4, 16, 24
    x, a, b = torch.randn(5, k), torch.randn(r, k), torch.randn(n, r)
    want = whole_delta(x, a, b)
    parts = [shard_pair(module, a, b, rank, world_size) for rank in range(world_size)]
    if SPLIT[module] is LoRASplit.COLUMN:
        assert all(torch.equal(pa, a) and pb.shape == (n // world_size, r) for pa, pb in parts)
        got = torch.cat([whole_delta(x, pa, pb) for pa, pb in parts], dim=1)
    else:
        assert all(torch.equal(pb, b) and pa.shape == (r, k // world_size) for pa, pb in parts)
        xs = x.chunk(world_size, dim=1)
        got = sum(whole_delta(xr, pa, pb) for xr, (pa, pb) in zip(xs, parts, strict=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shard_lora_model_keeps_one_rank_whole_and_refuses_an_uneven_split() -> None:
    a, b = torch.randn(2, 6), torch.randn(6, 2)
    model = LoRAModel(7, 2, 0.5, {(0, "q_proj"): (a, b), (0, "o_proj"): (a, b)})
    assert shard_lora_model(model, 0, 1) is model
    half = shard_lora_model(model, 1, 2)
    assert (half.lora_int_id, half.rank, half.scaling) == (7, 2, 0.5)
    assert torch.equal(half.weights[(0, "q_proj")][1], b[3:])
    assert torch.equal(half.weights[(0, "o_proj")][0], a[:, 3:])
    with pytest.raises(LoRAAdapterError, match="o_proj: 6 input features do not split over "
                       "tensor_parallel_size 4"):  # fmt: skip
        shard_lora_model(LoRAModel(7, 2, 0.5, {(0, "o_proj"): (a, b)}), 0, 4)


def test_row_parallel_with_at_one_rank_adds_after_the_layer() -> None:
    """The single-process path is unchanged: ``add(layer(x))``, bias included."""
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    got = row_parallel_with(layer, x, lambda y: y * 2)
    assert torch.equal(got, layer(x) * 2)


@pytest.mark.parametrize("packed", [False, True])
def test_tp2_row_parallel_delta_joins_the_partial_sum(packed: bool) -> None:
    """On 2 ranks, o_proj-like layers (bias, plain or prepacked): each rank's partial delta
    added before the all-reduce gives the whole layer plus the whole delta, the bias once."""
    for got, want in run_ranks(row_parallel_lora, 2, packed):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


PROMPTS = random_prompts([5, 9, 3, 13, 7])
DECODE_STEPS = 5


def test_tp2_mixed_adapters_equal_tp1_and_peft(lora_base: Path, adapters: dict[str, Path]) -> None:
    """Four adapters (every module, q/v only, MLP rsLoRA rank 16, k/o/down rank 2) and the
    base model in one batch: TP=2's rank-0 logits equal TP=1's (float32, within 1e-5), and
    each request's greedy tokens equal exactly TP=1's and peft's merged model's. TP=1's
    decode steps run the C++ decode loop with adapters, TP=2's the Python layers."""
    order = [adapters["all8"], None, adapters["qv4"], adapters["mlp16rs"], adapters["mixed2"]]
    script = Script(PROMPTS, DECODE_STEPS, use_kernel=True)
    got = run_ranks(lora_tokens, 2, lora_base, script, order)
    assert got[1] == []  # only rank 0 gets logits
    want = lora_tokens(None, lora_base, script, order)
    assert len(got[0]) == len(want) == DECODE_STEPS + 1
    for step, (g, w) in enumerate(zip(got[0], want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=f"step {step}")
    tp2 = torch.stack([g.argmax(-1) for g in got[0]], dim=1).tolist()  # [requests, steps]
    tp1 = torch.stack([w.argmax(-1) for w in want], dim=1).tolist()
    assert tp2 == tp1
    peft = [hf_greedy(merged_model(lora_base, a), p, DECODE_STEPS + 1)
            for a, p in zip(order, PROMPTS, strict=True)]  # fmt: skip
    assert tp2 == peft
    base = run_script(load(lora_base, script, None), script, None)  # the adapters matter
    base_tokens = torch.stack([b.argmax(-1) for b in base], dim=1).tolist()
    assert base_tokens[1] == tp2[1]
    assert sum(bt != t for bt, t in zip(base_tokens, tp2, strict=True)) == 4
