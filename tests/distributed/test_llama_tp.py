"""TP=2 (two gloo ranks) runs the Llama family exactly as TP=1 does: the same float32 logits
(within 1e-5) and greedy tokens over a prefill and greedy decode steps on a paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.config import Quantization
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.model.loader import load_model
from kvserve.quantization.apply import QuantOptions
from tests.distributed.scripts import Script, load, run_script, sharded_logits
from tests.distributed.utils import run_ranks
from tests.engine.utils import TINY, random_prompts

PROMPTS = random_prompts([5, 9, 3, 13])
DECODE_STEPS = 6


def sharded_runs(tp: TPGroup, path: Path, scripts: list[Script]) -> list[dict[str, Any]]:
    return [sharded_logits(tp, path, s) for s in scripts]


def assert_same_run(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> None:
    assert len(got) == len(want) == DECODE_STEPS + 1
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape == (len(PROMPTS), w.shape[1])
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=f"step {step}")
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"greedy tokens differ at step {step}"


def check_against_tp1(
    path: Path, scripts: list[Script], world_size: int, atol: float = 1e-5
) -> list[int]:
    """Each script's rank-0 logits equal TP=1's; returns each rank's K/V head count."""
    runs = run_ranks(sharded_runs, world_size, path, scripts)
    for i, script in enumerate(scripts):
        want = run_script(load(path, script, None), script, None)
        assert_same_run(runs[0][i]["logits"], want, atol=atol)
        assert all(r[i]["logits"] == [] for r in runs[1:])  # only rank 0 gets logits
    return [r[0]["num_kv_heads"] for r in runs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tp2_equals_tp1_float32(tiny_paths: dict[str, Path], arch: str) -> None:
    """Llama (llama3 rope scaling), Qwen2 (q/k/v bias, tied embeddings), Mistral; decode
    attention through SDPA and through the C++ kernel."""
    scripts = [
        Script(PROMPTS, DECODE_STEPS, use_kernel=False),
        Script(PROMPTS, DECODE_STEPS, use_kernel=True),
    ]
    # 2 K/V heads over 2 ranks: each rank's KV cache holds 1 head.
    assert check_against_tp1(tiny_paths[arch], scripts, 2) == [1, 1]


def fast_paths_equal_plain(tp: TPGroup, path: Path) -> bool:
    """On each rank, bf16 with prepacked shards and the fused C++ ops (RMSNorm, SiLU*up,
    RoPE + KV write with this rank's head counts) gives exactly the logits of plain shards
    with the PyTorch op chains, as at TP=1. (Both use the decode kernel, which rounds
    differently from SDPA in bf16, at TP=1 too.)"""
    plain = Script(PROMPTS, DECODE_STEPS, dtype=torch.bfloat16, use_kernel=True)
    fast = Script(PROMPTS, DECODE_STEPS, dtype=torch.bfloat16, use_kernel=True, prepack=True,
                  fused_ops=True)  # fmt: skip
    model = load(path, fast, tp)
    assert model.fused_ops_enabled
    got = run_script(model, fast, tp)
    want = run_script(load(path, plain, tp), plain, tp)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    return True


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_bf16_fast_paths_keep_outputs(tiny_paths: dict[str, Path], arch: str) -> None:
    assert run_ranks(fast_paths_equal_plain, 2, tiny_paths[arch]) == [True, True]


def refusals(tp: TPGroup, tiny: Path, three_heads: Path) -> bool:
    def load_it(path: Path, **kw: Any) -> None:
        load_model(path, torch.float32, "cpu", 64, tp=tp, **kw)

    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide "
                       r"num_attention_heads \(3\) and num_key_value_heads \(3\)"):  # fmt: skip
        load_it(three_heads)
    with pytest.raises(ValueError, match="transformers backend runs unsharded"):
        load_it(tiny, model_impl="transformers")
    with pytest.raises(ValueError, match="quantization_lm_head does not support tensor"):
        load_it(tiny, quant=QuantOptions(Quantization.INT8, lm_head=True))
    with pytest.raises(ValueError, match="quantization 'gguf' does not support tensor"):
        load_it(tiny, quant=QuantOptions(Quantization.GGUF, gguf_file=str(tiny / "none.gguf")))
    return True


def test_tp2_refusals(tiny_paths: dict[str, Path], tmp_path: Path) -> None:
    """What cannot be sharded is refused with a ValueError naming why, on every rank."""
    cfg = LlamaConfig(**{**TINY, "hidden_size": 48, "num_attention_heads": 3,
                         "num_key_value_heads": 3})  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    assert run_ranks(refusals, 2, tiny_paths["llama"], tmp_path) == [True, True]


@pytest.mark.slow
def test_builtin_model_tp3_equals_tp1(builtin_model_dir: Path) -> None:
    """SmolLM2-135M has 9 query heads and 3 K/V heads: 2 ranks cannot split them (refused,
    see test_tp2_refusals), so the built-in model runs on 3 ranks (3 heads, 1 K/V head each;
    vocabulary 49152 and MLP 1536 divide by 3).

    Its logits (|logit| up to 35, 30 layers) move by float32 summation order alone: measured
    TP=3 vs TP=1 at most 6.0e-5 over these steps, and TP=1's own decode kernel vs SDPA up to
    4.0e-5. Hence 2e-4 here; the greedy tokens must be equal exactly."""
    scripts = [Script(PROMPTS, DECODE_STEPS, use_kernel=True)]
    assert check_against_tp1(builtin_model_dir, scripts, 3, atol=2e-4) == [1, 1, 1]


def test_single_group_is_the_unsharded_model(tiny_paths: dict[str, Path]) -> None:
    """``tp=SINGLE`` (world size 1) builds the model ``tp=None`` builds: same logits, bit
    for bit, and the full K/V head count."""
    script = Script(PROMPTS, DECODE_STEPS)
    path = tiny_paths["qwen2"]
    single = load(path, script, SINGLE)
    assert single.num_kv_heads == 2
    got = run_script(single, script, SINGLE)
    want = run_script(load(path, script, None), script, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
