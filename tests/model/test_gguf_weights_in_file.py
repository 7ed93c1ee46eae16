"""A GGUF above ``KVSERVE_GGUF_DENSE_LIMIT_GB`` is not copied to disk in float32: its converted
folder holds the config, the tokenizer and ``gguf_weights.json``, and the loader dequantizes
the tensors from the file (``gguf_convert.iter_gguf_weights``). The limit is set to 0 here so
that a tiny Qwen3 Q8_0 file takes that path; each check compares it with the same file's
ordinary float32 folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from kvserve.model.builtin import converted_gguf_path, find_builtin_gguf
from kvserve.model.gguf_convert import (
    DENSE_LIMIT_ENV,
    GGUF_WEIGHTS_FILE,
    convert_gguf,
    iter_gguf_weights,
)
from kvserve.spec.truncated_draft import write_truncated_draft
from tests.model.test_gguf_families import FAST, LAYERS, MAX_TOKENS, PROMPTS, make_model
from tests.model.test_gguf_families import write_family_gguf as write_gguf


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 as a Q8_0 GGUF with a tokenizer."""
    out = tmp_path_factory.mktemp("qwen3-q8_0") / "qwen3-q8_0.gguf"
    return write_gguf(make_model("qwen3"), "qwen3", out, find_builtin_gguf(), T.Q8_0)


@pytest.fixture(scope="module")
def folders(q8_0: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The file converted both ways: "dense" (float32 safetensors), "in_file" (limit 0)."""
    work = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DENSE_LIMIT_ENV, "0")
        in_file = convert_gguf(q8_0, work / "in_file")
    return {"dense": convert_gguf(q8_0, work / "dense"), "in_file": in_file}


def test_the_folder_names_the_file_and_holds_no_weights(
    q8_0: Path, folders: dict[str, Path]
) -> None:
    in_file, dense = folders["in_file"], folders["dense"]
    assert not list(in_file.glob("*.safetensors")) and list(dense.glob("*.safetensors"))
    ref = json.loads((in_file / GGUF_WEIGHTS_FILE).read_text())
    want = load_file(str(dense / "model.safetensors"))
    assert ref == {"gguf": str(q8_0), "float32_bytes": 4 * sum(t.numel() for t in want.values())}
    # the same config and tokenizer files as the dense folder, and nothing bigger than them
    assert {p.name for p in in_file.iterdir()} == {
        *(p.name for p in dense.iterdir() if p.suffix != ".safetensors"),
        GGUF_WEIGHTS_FILE,
    }
    assert (in_file / "config.json").read_text() == (dense / "config.json").read_text()


def test_tensors_read_from_the_file_equal_the_float32_copy(folders: dict[str, Path]) -> None:
    want = load_file(str(folders["dense"] / "model.safetensors"))
    skip = {"model.layers.0.mlp.down_proj.weight"}
    got = dict(iter_gguf_weights(folders["in_file"], skip))
    assert list(got) == list(want)  # every tensor, once, in the file's order
    for name, tensor in got.items():
        if name in skip:  # shape and dtype only, never read
            assert tensor.is_meta and tensor.shape == want[name].shape
            assert tensor.dtype == torch.float32
        else:
            assert torch.equal(tensor, want[name]), name


def test_truncated_draft_of_a_folder_that_reads_the_file(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    a = write_truncated_draft(folders["in_file"], tmp_path / "a", 1)
    b = write_truncated_draft(folders["dense"], tmp_path / "b", 1)
    assert not (a / GGUF_WEIGHTS_FILE).exists()
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(ta) == list(tb) and not any(".layers.1." in n for n in ta)
    assert all(torch.equal(ta[n], tb[n]) for n in ta)


def test_a_moved_file_and_the_transformers_backend_are_refused(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from kvserve import LLM

    with pytest.raises(ValueError, match="load into kvserve's native models only"):
        LLM(model=str(folders["in_file"]), model_impl="transformers", **FAST)
    moved = shutil.copytree(folders["in_file"], tmp_path / "moved")
    (moved / GGUF_WEIGHTS_FILE).write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    with pytest.raises(FileNotFoundError, match=r"gone\.gguf, which is gone; delete"):
        LLM(model=str(moved), **FAST)


@pytest.mark.slow
def test_served_from_the_file_gives_the_float32_folders_tokens(
    q8_0: Path, folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense and ``--quantization gguf`` loads of the file-reading folder give the greedy
    tokens of the float32 folder."""
    from kvserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    monkeypatch.setenv(DENSE_LIMIT_ENV, "0")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert (converted_gguf_path(q8_0) / GGUF_WEIGHTS_FILE).is_file()  # what the gguf run loads
    tokens = {}
    runs = {"dense": (folders["dense"], None), "in_file": (folders["in_file"], None),
            "gguf": (q8_0, "gguf")}  # fmt: skip
    for run, (model, quantization) in runs.items():
        llm = LLM(model=str(model), quantization=quantization, **FAST)
        if quantization == "gguf":  # q/k/v, o, gate/up, down of each layer, from the file
            assert llm.engine.runner.model.quant_report.layers == 4 * LAYERS
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()
        tokens[run] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["in_file"] == tokens["dense"] == tokens["gguf"]
    assert len({t[0] for t in tokens["dense"]}) == len(PROMPTS)  # not one repeated token


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.F16])
def test_large_tensors_dequantize_a_block_of_rows_at_a_time(
    qtype: T, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dequantize_rows`` in blocks of ``DEQUANT_ROWS`` (gguf's temporaries stay a block's
    size) gives the whole tensor's float32 values, a last partial block included."""
    from gguf import GGML_QUANT_SIZES

    from kvserve.model import gguf_convert
    from tests.quantization.test_gguf_weights import _F16_FIELDS

    rows, cols = 70, 512
    rng = np.random.default_rng(0)
    if qtype == T.F16:
        raw = rng.standard_normal((rows, cols)).astype(np.float16)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        for b in range(cols // block):  # finite float16 d (and dmin) in every block
            for field in _F16_FIELDS[qtype]:
                d = (rng.standard_normal(rows) * 0.01).astype(np.float16)
                raw[:, b * size + field : b * size + field + 2] = d.view(np.uint8).reshape(rows, 2)
    whole = gguf_convert.dequantize(raw, qtype)
    monkeypatch.setattr(gguf_convert, "DEQUANT_ROWS", 16)
    blocks = gguf_convert.dequantize_rows(raw, qtype)
    assert blocks.dtype == np.float32 and blocks.shape == (rows, cols)
    assert np.array_equal(blocks, whole)
