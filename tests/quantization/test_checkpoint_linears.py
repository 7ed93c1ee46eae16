"""``CheckpointLinears``: a pre-quantized checkpoint's projections read one fused module at a
time give exactly what the whole-dict split gives, and the loader's stream reads none of the
quantized tensors (they come as meta weights of the right shapes)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from kvserve.quantization.checkpoint_linears import CheckpointLinears
from kvserve.quantization.compressed_tensors import checkpoint_scheme
from tests.engine.test_awq import write_awq
from tests.engine.test_compressed_tensors import write_checkpoint
from tests.engine.test_gptq import write_gptq
from tests.engine.utils import make_tiny_model, split_checkpoint

WRITERS: dict[str, Callable[[Path, Path], object]] = {
    "compressed-tensors": lambda src, dst: write_checkpoint(src, dst, 4, 32, False),
    "awq": lambda src, dst: write_awq(src, dst, 32),
    "gptq act-order": lambda src, dst: write_gptq(src, dst, 4, 32, True, act_order=True),
    "gptq 8-bit": lambda src, dst: write_gptq(src, dst, 8, None, False),
}
LEAVES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
          "weight_zero_point", "weight_shape")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path)
    return path


@pytest.mark.parametrize("kind", list(WRITERS))
def test_modules_equal_the_whole_split(tiny_llama: Path, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "q"
    WRITERS[kind](tiny_llama, path)
    scheme = checkpoint_scheme(AutoConfig.from_pretrained(path))
    assert scheme is not None
    state = load_file(str(path / "model.safetensors"))
    dense, fused = split_checkpoint(state, scheme)
    source = CheckpointLinears([path / "model.safetensors"], scheme)

    assert set(source.modules) == set(fused)  # 2 layers x qkv, o, gate_up, down
    assert len(source.modules) == 8
    for module, want in fused.items():
        got = source.take(module)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert (got.zeros is None) == (want.zeros is None)
        assert got.zeros is None or torch.equal(got.zeros, want.zeros)  # type: ignore[arg-type]
        assert (got.in_perm is None) == (want.in_perm is None)
        assert (got.bits, got.group_size) == (want.bits, want.group_size)
    # the stream drops every quantized tensor; load_weights gets meta weights in their place
    assert source.checkpoint_names == {n for n in state if n.rsplit(".", 1)[1] in LEAVES}
    metas = dict(source.meta_weights())
    assert set(metas) == {n for n in dense if n not in state}  # the projections' weights
    assert len(metas) == 14
    for name, t in metas.items():
        assert t.is_meta and t.shape == dense[name].shape, name
