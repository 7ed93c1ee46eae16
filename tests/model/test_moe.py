"""Native Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE: logits equal transformers' (float32,
prefill then decode, both attention backends), checkpoints with per-expert or stacked expert
weights load, incomplete ones and pre-quantized experts are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from kvserve.config import Quantization
from kvserve.model.llama import MLP
from kvserve.model.loader import load_model
from kvserve.model.moe import MoEForCausalLM, OlmoeAttention, SparseMoeBlock
from kvserve.moe.router import route
from tests.model.tiny_moe import MOE_ARCHS, make_moe_model
from tests.model.tiny_native import kvserve_logits

IDS = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    out = {}
    for arch in MOE_ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, make_moe_model(arch, path))
    return out


def reference_logits(hf: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([IDS]), use_cache=False).logits[0, 8:]  # [12, V]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(moe: dict[str, tuple[Path, PreTrainedModel]], arch: str) -> None:
    """A 9-token prefill then 11 decode steps on the SDPA backend and the PyTorch op chains
    (the engine tests run the C++ kernels and fused ops)."""
    path, hf = moe[arch]
    model = load_model(path, torch.float32, "cpu", max_positions=64)
    assert isinstance(model, MoEForCausalLM)
    mlps = [type(layer.mlp) for layer in model.layers]
    assert mlps == ([MLP, SparseMoeBlock] if arch == "qwen2_moe" else [SparseMoeBlock] * 2)
    assert isinstance(model.layers[0].self_attn, OlmoeAttention) == (arch == "olmoe")
    got = kvserve_logits(model, IDS, 9, False)
    torch.testing.assert_close(got, reference_logits(hf), atol=2e-5, rtol=1e-5)
    # the tiny models really route: the tokens' top-2 experts cover most experts
    block = model.layers[1].mlp
    x = model.layers[1].input_layernorm(model.embed_tokens(torch.tensor(IDS)))
    _, ids = route(block.gate(x), block.router)
    assert ids.unique().numel() >= block.router.num_experts * 3 // 4


def test_stacked_expert_checkpoint(
    moe: dict[str, tuple[Path, PreTrainedModel]], tmp_path: Path
) -> None:
    """transformers 5's own in-memory names (``experts.gate_up_proj [E, 2I, H]``) load too."""
    src, hf = moe["qwen3_moe"]
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(tmp_path, torch.float32, "cpu", max_positions=64)
    got = kvserve_logits(model, IDS, 9, False)
    torch.testing.assert_close(got, reference_logits(hf), atol=2e-5, rtol=1e-5)


def test_missing_expert_refused(
    moe: dict[str, tuple[Path, PreTrainedModel]], tmp_path: Path
) -> None:
    src, _ = moe["mixtral"]
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: layers\.1\.mlp\.experts\.gate_up"):
        load_model(tmp_path, torch.float32, "cpu", max_positions=64)


def test_prequantized_experts_refused() -> None:
    """Pre-quantized checkpoints would leave the experts dense: refused by name; RTN and a
    GGUF's own blocks (tests/model/test_gguf_moe.py) quantize them."""
    for method in (Quantization.COMPRESSED_TENSORS, Quantization.AWQ, Quantization.GPTQ):
        assert "not pre-quantized" in str(MoEForCausalLM.quantization_refusal(method))
    for method in (None, Quantization.INT8, Quantization.INT4, Quantization.GGUF):
        assert MoEForCausalLM.quantization_refusal(method) is None
