"""Reading PEFT folders: slices, scaling, and a clear reason for every adapter refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from kvserve.lora.peft_loader import (
    LoRAAdapterError,
    LoRAModel,
    LoRAModelDims,
    load_peft_adapter,
)
from tests.lora.utils import SPECS


def dims(base: Path) -> LoRAModelDims:
    return LoRAModelDims.from_hf_config(AutoConfig.from_pretrained(base))


def load(base: Path, folder: Path, max_rank: int = 16) -> LoRAModel:
    return load_peft_adapter(folder, 1, dims(base), max_rank, torch.float32)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_weights_and_scaling(lora_base: Path, adapters: dict[str, Path]) -> None:
    raw = load_file(str(adapters["qv4"] / "adapter_model.safetensors"))
    model = load(lora_base, adapters["qv4"])
    spec = SPECS["qv4"]
    assert (model.rank, model.scaling) == (4, spec.alpha / spec.r)
    assert sorted(model.weights) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    a, b = model.weights[(1, "v_proj")]
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    assert torch.equal(a, raw[key.format("A")])
    torch.testing.assert_close(b, raw[key.format("B")] * 2.0)  # alpha / r = 8 / 4
    rs = load(lora_base, adapters["mlp16rs"])  # rsLoRA: alpha / sqrt(r)
    assert rs.scaling == pytest.approx(32 / math.sqrt(16))


def test_rank_above_max(lora_base: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(LoRAAdapterError, match="rank 16 is above max_lora_rank 8"):
        load(lora_base, adapters["mlp16rs"], max_rank=8)


def test_target_modules_the_model_lacks(
    lora_base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy(adapters["qv4"], tmp_path / "fc")
    edit_config(folder, target_modules=["q_proj", "fc1"])
    with pytest.raises(LoRAAdapterError, match=r"targets modules the model lacks .*\['fc1'\]"):
        load(lora_base, folder)
    # a weight for a module kvserve does not adapt (an embedding adapter)
    folder = copy(adapters["qv4"], tmp_path / "emb")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 256)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="lora_embedding_A"):
        load(lora_base, folder)


def test_adapter_for_another_base(
    lora_base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy(adapters["qv4"], tmp_path / "other")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 96)  # hidden 96, not 64
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"layers.0.q_proj: .*\(64 in, 64 out\).*another"):
        load(lora_base, folder)
    deep = copy(adapters["qv4"], tmp_path / "deep")  # a layer the 2-layer model lacks
    tensors = load_file(str(deep / "adapter_model.safetensors"))
    for ab in "AB":
        src = f"base_model.model.model.layers.1.self_attn.q_proj.lora_{ab}.weight"
        tensors[src.replace("layers.1", "layers.5")] = tensors[src].clone()
    save_file(tensors, str(deep / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="layer 5, but the model has 2 layers"):
        load(lora_base, deep)


def test_broken_files(lora_base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        load(lora_base, tmp_path / "nowhere")
    folder = copy(adapters["qv4"], tmp_path / "garbage")
    (folder / "adapter_model.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(LoRAAdapterError, match="cannot read the adapter's weights"):
        load(lora_base, folder)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        load(lora_base, folder)
    half = copy(adapters["qv4"], tmp_path / "half")
    tensors = load_file(str(half / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(half / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"layers\.0\.q_proj: lora_B is missing"):
        load(lora_base, half)
    dora = copy(adapters["qv4"], tmp_path / "dora")
    edit_config(dora, use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        load(lora_base, dora)
