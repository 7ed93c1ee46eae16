"""``--quantization-lm-head``: the LM head's quantized weights, its padding, and the GGUF
output tensor it keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvserve.config import Quantization, QuantizedActivations
from kvserve.model.loader import load_model
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.gguf_weights import read_output_weight
from kvserve.quantization.lm_head import (
    QuantLMHead,
    lm_head_weight,
    pad_rows,
    wants_quantized_head,
)
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import QuantizedWeight, quantize_rtn
from tests.quantization.test_gguf_weights import _random_k_blocks

SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}  # fmt: skip
NONE = QuantizedActivations.NONE


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.eval()
    model.save_pretrained(path)  # type: ignore[operator]
    return path


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied, with a vocabulary of 100 rows: not a multiple of the kernels' 16."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, tie_word_embeddings=False, **SIZES)
    return _save(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tied_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=96, tie_word_embeddings=True, **SIZES)
    return _save(Qwen2ForCausalLM(cfg), tmp_path_factory.mktemp("qwen2"))


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_pad_rows_adds_zero_weights() -> None:
    w = torch.randn(5, 64)
    qw = quantize_rtn(w, 4, 32)  # with zeros
    padded = pad_rows(qw)
    assert padded.shape == (16, 64) and padded.bits == 4 and padded.group_size == 32
    assert torch.equal(padded.codes[:5], qw.codes) and not padded.codes[5:].any()
    assert padded.zeros is not None and not padded.zeros[5:].any()
    assert not padded.scales[5:].any()
    assert torch.equal(padded.dequantize()[:5], qw.dequantize())
    assert not padded.dequantize()[5:].any()
    int8 = quantize_rtn(torch.randn(32, 64), 8, None)
    assert pad_rows(int8) is int8  # already a multiple of 16


@pytest.mark.parametrize(("fixture", "method"), [("untied_llama", Quantization.INT4),
                                                 ("tied_qwen2", Quantization.INT8)])  # fmt: skip
def test_lm_head_holds_int8_rounded_weights(
    request: pytest.FixtureRequest, fixture: str, method: Quantization
) -> None:
    """The LM head computes with the checkpoint's head rounded to int8 per row, and the
    embeddings keep their float weights (a tied head gets its own quantized copy)."""
    path: Path = request.getfixturevalue(fixture)
    state = _state(path)
    quant = QuantOptions(method, activations=NONE, lm_head=True)
    model = load_model(path, torch.float32, "cpu", 64, quant=quant)
    head = model.lm_head
    assert isinstance(head, QuantLMHead) and isinstance(head.layer, QuantLinear)
    assert head.layer.bits == 8 and head.layer.path == "kernel"
    embed = state["model.embed_tokens.weight"]
    w = state.get("lm_head.weight", embed)  # tied: the embedding table
    vocab = w.shape[0]
    assert head.layer.out_features == -(-vocab // 16) * 16
    got = head(torch.eye(64))  # [64, vocab]: column v is row v of the weight
    assert got.shape == (64, vocab)
    assert torch.equal(got.t(), quantize_rtn(w, 8, None).dequantize())
    assert torch.equal(model.embed_tokens.weight, embed)
    report = model.quant_report
    assert report.lm_head.startswith("int8 per channel") and report.layers == 2 * 4
    plain = load_model(path, torch.float32, "cpu", 64, quant=QuantOptions(method, activations=NONE))
    assert not isinstance(plain.lm_head, QuantLMHead) and plain.quant_report.lm_head is None


def test_transformers_backend_refuses_a_quantized_head(untied_llama: Path) -> None:
    quant = QuantOptions(Quantization.INT8, lm_head=True)
    with pytest.raises(ValueError, match="native model classes, not the transformers backend"):
        load_model(untied_llama, torch.float32, "cpu", 64, model_impl="transformers", quant=quant)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, T]]) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (data, qtype) in tensors.items():
        if qtype in (T.F32,):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _values(qw: QuantizedWeight) -> np.ndarray:
    return qw.dequantize().numpy()


def test_gguf_output_tensor_is_read_in_its_own_type(tmp_path: Path) -> None:
    """``output.weight`` as stored (llama.cpp's Q6_K), else the tied ``token_embd.weight``;
    None when the head is stored as floats."""
    n, k = 32, 512
    floats = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    q6 = _random_k_blocks(T.Q6_K, 1)  # [32, 420] bytes: the Q6_K blocks of 32 x 512 weights
    q8 = quantize(floats, T.Q8_0)
    path = _write(tmp_path / "untied.gguf", {"token_embd.weight": (q8, T.Q8_0),
                                             "output.weight": (q6, T.Q6_K)})  # fmt: skip
    got = read_output_weight(path)
    assert got is not None
    qw, name = got
    assert name == "Q6_K" and qw.shape == (n, k) and qw.group_size == 16
    assert np.array_equal(_values(qw), dequantize(q6, T.Q6_K).reshape(n, k))
    tied = _write(tmp_path / "tied.gguf", {"token_embd.weight": (q8, T.Q8_0)})
    got = read_output_weight(tied)
    assert got is not None and got[1] == "Q8_0"
    assert np.array_equal(_values(got[0]), dequantize(q8, T.Q8_0).reshape(n, k))
    f32 = _write(tmp_path / "f32.gguf", {"token_embd.weight": (q8, T.Q8_0),
                                         "output.weight": (floats, T.F32)})  # fmt: skip
    assert read_output_weight(f32) is None


@pytest.mark.slow
def test_builtin_gguf_head_is_its_q8_0_embedding_table(builtin_model_dir: Path) -> None:
    """The built-in Q4_1 GGUF ties its LM head to a Q8_0 embedding table: with
    --quantization-lm-head the head keeps exactly those Q8_0 values (the converted folder's
    dequantized table)."""
    from kvserve.model.builtin import find_builtin_gguf

    quant = QuantOptions(Quantization.GGUF, None, str(find_builtin_gguf()), activations=NONE,
                         lm_head=True)  # fmt: skip
    model = load_model(builtin_model_dir, torch.float32, "cpu", 256, quant=quant)
    assert isinstance(model.lm_head, QuantLMHead) and model.quant_report.lm_head == "Q8_0"
    embed = _state(builtin_model_dir)["model.embed_tokens.weight"]  # [49152, 576]
    got = model.lm_head(torch.eye(576)).t()  # [49152, 576]
    assert torch.equal(got, embed)
    assert torch.equal(model.embed_tokens.weight, embed)


def test_unset_option_keeps_a_gguf_files_own_head(tmp_path: Path) -> None:
    """``quantization_lm_head`` unset: on for --quantization gguf on a native unsharded model,
    off otherwise, as given when set; unset, a head the file stores as floats stays dense
    (``lm_head_weight`` gives None) where the option set quantizes it to int8."""
    n, k = 32, 512
    floats = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    tensors = {"token_embd.weight": (quantize(floats, T.Q8_0), T.Q8_0),
               "output.weight": (_random_k_blocks(T.Q6_K, 1), T.Q6_K)}  # fmt: skip
    q6 = _write(tmp_path / "q6.gguf", tensors)
    f32 = _write(tmp_path / "f32.gguf", {"output.weight": (floats, T.F32)})

    def opts(lm_head: bool | None, method: Quantization = Quantization.GGUF,
             file: Path = q6) -> QuantOptions:  # fmt: skip
        return QuantOptions(method, None, str(file), lm_head=lm_head)

    assert wants_quantized_head(opts(None), native=True, tp_size=1)
    assert not wants_quantized_head(opts(None), native=False, tp_size=1)
    assert not wants_quantized_head(opts(None), native=True, tp_size=2)
    assert not wants_quantized_head(opts(None, Quantization.INT8), native=True, tp_size=1)
    assert not wants_quantized_head(opts(False), native=True, tp_size=1)
    assert wants_quantized_head(opts(True, Quantization.INT8), native=False, tp_size=2)
    weight = torch.from_numpy(floats)
    got = lm_head_weight(weight, opts(None))
    assert got is not None and got[1] == "Q6_K"
    assert lm_head_weight(weight, opts(None, file=f32)) is None
    got = lm_head_weight(weight, opts(True, file=f32))
    assert got is not None and got[1].startswith("int8 per channel")


@pytest.mark.slow
def test_builtin_gguf_head_is_quantized_unless_turned_off(builtin_model_dir: Path) -> None:
    """The engine's default for --quantization gguf: the file's Q8_0 head; with
    --no-quantization-lm-head the serving dtype."""
    from kvserve.model.builtin import find_builtin_gguf

    for lm_head, want in ((None, "Q8_0"), (False, None)):
        quant = QuantOptions(Quantization.GGUF, None, str(find_builtin_gguf()),
                             activations=NONE, lm_head=lm_head)  # fmt: skip
        model = load_model(builtin_model_dir, torch.float32, "cpu", 256, quant=quant)
        assert model.quant_report.lm_head == want
        assert isinstance(model.lm_head, QuantLMHead) == (want is not None)
