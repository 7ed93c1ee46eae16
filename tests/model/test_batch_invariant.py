"""Batch-invariant mode's model side (``kvserve/model/batch_invariant.py``): every linear is
swapped for the fixed-order one (a tied LM head stays tied, widened layers lose their row
limit), MoE models are refused by name, and the families with windows, soft-caps and q/k
norms (Gemma 2, Gemma 3, Qwen3) give bitwise the same tokens and logprobs alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.engine.llm import LLM
from kvserve.model.batch_invariant import (
    UNLIMITED_ROWS,
    BatchInvariantLinear,
    batch_invariant_refusal,
    make_batch_invariant,
)
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import MoEForCausalLM
from kvserve.model.wide_linear import WideLinear, widen_linears
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import QuantLinear
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import make_tiny_model, random_prompts
from tests.model.tiny_native import make_native_model, native_config

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def _tiny_llama(tied: bool) -> LlamaForCausalLM:
    cfg = native_config("mistral", tie_word_embeddings=tied, architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(cfg, max_positions=64)


def test_every_linear_is_swapped_and_a_tied_head_stays_tied() -> None:
    model = _tiny_llama(tied=True)
    # 2 layers x (qkv, o, gate_up, down) + the LM head
    assert make_batch_invariant(model) == 9
    assert model.batch_invariant  # type: ignore[truthy-function]
    plain = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert not plain  # every nn.Linear subclass (the parallel layers, the LM head) swapped
    assert isinstance(model.lm_head, BatchInvariantLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, BatchInvariantLinear)
    x = torch.randn(5, layer.in_features)
    torch.testing.assert_close(layer(x), x @ layer.weight.t())


def test_widened_layers_take_every_row_through_the_kernel() -> None:
    model = _tiny_llama(tied=False)
    widen_linears(model, torch.bfloat16)
    make_batch_invariant(model)
    wide = [m for m in model.modules() if isinstance(m, WideLinear)]
    assert wide and all(m.direct_rows == 0 for m in wide)
    x = torch.randn(300, wide[0].in_features)  # above the kernel's default 256-row limit
    assert torch.equal(wide[0](x)[7:8], wide[0](x[7:8]))


def test_moe_and_foreign_classes_are_refused() -> None:
    moe = MoEForCausalLM.__new__(MoEForCausalLM)  # the class attribute is what is read
    reason = batch_invariant_refusal(moe)
    assert reason is not None and "MoEForCausalLM does not support it" in reason
    assert batch_invariant_refusal(nn.Linear(2, 2)) is not None
    assert batch_invariant_refusal(_tiny_llama(tied=False)) is None


def _alone_equal_batched(llm: LLM) -> None:
    """Six requests (greedy and seeded) alone, then in one batch: same tokens and logprobs."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 30, 9, 23, 12], seed=9)]
    params = [
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, seed=i,
                       temperature=0.8 if i % 2 else 0.0)
        for i in range(len(prompts))
    ]  # fmt: skip

    def result(outs: list) -> list:
        return [(o.outputs[0].token_ids,
                 [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]  # fmt: skip

    alone = []
    for p, sp in zip(prompts, params, strict=True):
        llm.reset_prefix_cache()
        alone += result(llm.generate([p], sp, use_tqdm=False))
    llm.reset_prefix_cache()
    assert result(llm.generate(prompts, params, use_tqdm=False)) == alone


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3"])
def test_windowed_soft_capped_families_alone_equal_batched(arch: str, tmp_path: Path) -> None:
    make_native_model(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", batch_invariant=True, num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=24)  # fmt: skip
    _alone_equal_batched(llm)


@pytest.mark.parametrize(
    ("dtype", "quant"),
    [
        ("float32", {"quantization": "int8", "quantization_lm_head": True}),
        ("bfloat16", {"quantization": "int4"}),
        ("float32", {"quantization": "int4", "quantization_activations": "int8"}),
    ],
)
def test_quantized_models_alone_equal_batched(
    dtype: str, quant: dict[str, object], tmp_path: Path
) -> None:
    """Quantized layers take their direct kernel path for every row count (the tiled path,
    above 4 rows by default, made a row depend on its batch) or the int8-activation kernel."""
    make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype=dtype, batch_invariant=True, num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=24, **quant)  # fmt: skip
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.path == "a8" or m.direct_rows == UNLIMITED_ROWS for m in layers)
    _alone_equal_batched(llm)


def test_widened_float32_model_alone_equals_batched(tmp_path: Path) -> None:
    """float32 compute on bf16-stored weights (the AVX2 kind's dtype=auto): every row count
    through the packed kernel, in the Python layers and the C++ decode loop."""
    make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", weight_dtype="bfloat16", batch_invariant=True,
              num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)  # fmt: skip
    model = llm.engine.runner.model
    wide = [m for m in model.modules() if isinstance(m, WideLinear)]
    assert len(wide) == 9 and all(m.direct_rows == 0 for m in wide)
    _alone_equal_batched(llm)
