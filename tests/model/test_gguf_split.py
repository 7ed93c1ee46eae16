"""A GGUF model split into shards (``name-00001-of-00004.gguf``, as llama.cpp's
``convert_hf_to_gguf.py --split-max-tensors`` and ``gguf-split`` write it: metadata in the
first file, tensors spread over all) loads as one model from any of its files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.gguf_names import GGUFFiles
from kvserve.quantization.gguf_weights import GGUFLinears, read_output_weight
from tests.model.test_gguf_gemma_phi3 import MIXED, _generate, make_model, write_gguf


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path, Path]:
    """(a Gemma 2 model, its file with mixed quant types, the same split 7 tensors a file: 24
    tensors in 4 files)."""
    model, work = make_model("gemma2"), tmp_path_factory.mktemp("split")
    whole = write_gguf(model, "gemma2", work / "whole.gguf", MIXED["gemma2"])
    (work / "parts").mkdir()
    first = write_gguf(model, "gemma2", work / "parts" / "g2.gguf", MIXED["gemma2"], split=7)
    return model, whole, first


def test_every_shard_is_read(split: tuple[PreTrainedModel, Path, Path]) -> None:
    _, whole, first = split
    files = GGUFFiles(first.with_name("g2-00003-of-00004.gguf"))  # any shard names them all
    assert [p.name for p in files.paths] == [f"g2-0000{i}-of-00004.gguf" for i in range(1, 5)]
    assert len({files.path_of[t.name] for t in files.tensors}) == 4
    assert sorted(t.name for t in files.tensors) == sorted(t.name for t in GGUFFiles(whole).tensors)


def test_split_converts_and_quantizes_as_the_whole_file(
    split: tuple[PreTrainedModel, Path, Path], tmp_path: Path
) -> None:
    model, whole, first = split
    a = convert_gguf(whole, tmp_path / "whole")
    b = convert_gguf(first.with_name("g2-00002-of-00004.gguf"), tmp_path / "split")
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    x, y = GGUFLinears(whole, model.config), GGUFLinears(first, model.config)
    assert sorted(x.modules) == sorted(y.modules) and len(x.modules) == 8
    for module in x.modules:
        assert torch.equal(x.take(module).dequantize(), y.take(module).dequantize()), module
    head_x, head_y = read_output_weight(whole), read_output_weight(first)
    assert head_x is None and head_y is None  # an F32 embedding: no quantized head


def test_missing_shard_is_named(split: tuple[PreTrainedModel, Path, Path], tmp_path: Path) -> None:
    _, _, first = split
    lone = tmp_path / "g2-00001-of-00004.gguf"
    lone.write_bytes(first.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"one of 4 GGUF shards; missing: \['g2-00002"):
        convert_gguf(lone, tmp_path / "out")


@pytest.mark.slow
def test_split_serves_the_whole_files_tokens(
    split: tuple[PreTrainedModel, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, whole, first = split
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    want, _ = _generate(str(whole))
    got, layers = _generate(str(first), "gguf")
    assert got == want and layers == 8
