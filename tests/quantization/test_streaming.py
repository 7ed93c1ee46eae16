"""Quantizing while the checkpoint loads (``streaming.py``): never more than one decoder
layer's dense linear weights alive, none at all for a GGUF's pre-quantized projections, and
exactly the layers that loading everything first and quantizing after gives."""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvserve.config import Quantization
from kvserve.model import llama
from kvserve.model.gguf_convert import permute_rotary
from kvserve.model.loader import load_model
from kvserve.quantization import apply
from kvserve.quantization.apply import QuantOptions, quantize_model
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import quantize_rtn, relative_error

CPU = torch.device("cpu")
LAYERS = 4
SIZES: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}  # fmt: skip
LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(LlamaConfig(**SIZES)), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: q/k/v biases, loaded through the stand-in too."""
    torch.manual_seed(1)
    return _save(Qwen2ForCausalLM(Qwen2Config(**SIZES)), tmp_path_factory.mktemp("qwen2"))


class LoadSpy:
    """Watches ``load_weights``: after each checkpoint tensor it consumes, the decoder layers
    whose dense linear weights (2-D parameters with storage) are alive, whether or not they
    are still in the model (the loader's own parameter table keeps them reachable)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.alive: list[set[int]] = []  # per tensor consumed
        self.meta: list[str] = []  # checkpoint tensors handed over unread (meta)
        self._params: list[tuple[int, weakref.ref[torch.Tensor]]] = []
        original = llama.LlamaForCausalLM.load_weights

        def spied(model: llama.LlamaForCausalLM, weights: Iterable[tuple[str, Any]]) -> None:
            original(model, self._watch(model, weights))

        monkeypatch.setattr(llama.LlamaForCausalLM, "load_weights", spied)

    def _watch(
        self, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self._observe(model)
        for name, tensor in weights:
            if tensor.is_meta:
                self.meta.append(name)
            yield name, tensor
            self._observe(model)  # the tensor has been loaded

    def _observe(self, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            match = LAYER_RE.match(name)
            if match and p.dim() == 2:
                self._params.append((int(match.group(1)), weakref.ref(p)))
        dense = set()
        for layer, ref in self._params:
            p = ref()
            if p is not None and not p.is_meta and p.untyped_storage().nbytes() > 0:
                dense.add(layer)
        self.alive.append(dense)


def _layer_tensors(layer: QuantLinear) -> dict[str, Any]:
    """What a quantized layer computes with (packed codes, scales, zeros, bias, offset)."""
    state = {k: v for k, v in vars(layer).items()
             if isinstance(v, (torch.Tensor, int)) and not isinstance(v, bool)}  # fmt: skip
    if layer.qweight is not None:
        state.update(vars(layer.qweight))
    return state


def _assert_same_layers(got: torch.nn.Module, want: torch.nn.Module) -> int:
    pairs = [(n, m, want.get_submodule(n)) for n, m in got.named_modules()
             if isinstance(m, QuantLinear)]  # fmt: skip
    for name, a, b in pairs:
        assert isinstance(b, QuantLinear), name
        sa, sb = _layer_tensors(a), _layer_tensors(b)
        assert sa.keys() == sb.keys(), name
        for key, value in sa.items():
            other = sb[key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{name}.{key}"
    return len(pairs)


def _load_then_quantize(path: Path, quant: QuantOptions) -> torch.nn.Module:
    """The reference: every weight loaded first, then ``quantize_model``."""
    model = load_model(path, torch.float32, CPU, 64)
    model.quant_report = quantize_model(model, quant, CPU, torch.float32)  # type: ignore[attr-defined]
    return model  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("arch", "method", "group"),
    [("llama", "int4", None), ("llama", "int8", None), ("qwen2", "int8", 32)],
)
def test_rtn_load_holds_one_layer_of_dense_weights(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, arch: str, method: str,
    group: int | None,
) -> None:  # fmt: skip
    path = request.getfixturevalue(f"tiny_{arch}")
    quant = QuantOptions(Quantization(method), group)
    want = _load_then_quantize(path, quant)
    spy = LoadSpy(monkeypatch)
    got = load_model(path, torch.float32, CPU, 64, quant=quant)
    # every layer's dense weights came and went, never two layers' at once
    assert max(len(s) for s in spy.alive) == 1
    assert set().union(*spy.alive) == set(range(LAYERS))
    assert spy.alive[-1] == set() and spy.meta == []
    assert _assert_same_layers(got, want) == 4 * LAYERS
    a, b = got.quant_report, want.quant_report  # type: ignore[attr-defined]
    assert (a.layers, a.weight_bytes, a.dense_bytes) == (b.layers, b.weight_bytes, b.dense_bytes)
    assert a.errors == pytest.approx(b.errors, rel=1e-6)


def _write_gguf(folder: Path, out: Path) -> tuple[Path, set[str]]:
    """The folder's projections in a GGUF as llama.cpp stores them (q/k rows permuted):
    Q8_0 and Q4_0, but layer 1's MLP as F32 (it stays an ordinary layer). Only tensors:
    the loader reads nothing else of it. Returns the file and the float projections."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    heads = {"attn_q": SIZES["num_attention_heads"], "attn_k": SIZES["num_key_value_heads"]}
    writer = gguf.GGUFWriter(out, "llama")
    floats = set()
    for i in range(LAYERS):
        for hf, kind in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if kind in heads:
                w = permute_rotary(w, heads[kind])
            w_np = np.ascontiguousarray(w.numpy())
            if i == 1 and hf.startswith("mlp."):
                writer.add_tensor(f"blk.{i}.{kind}.weight", w_np)
                floats.add(f"model.layers.{i}.{hf}.weight")
                continue
            qtype = T.Q8_0 if i % 2 else T.Q4_0
            raw = gguf.quants.quantize(w_np, qtype)
            writer.add_tensor(f"blk.{i}.{kind}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, floats


def test_gguf_load_never_builds_dense_quantized_weights(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, floats = _write_gguf(tiny_llama, tmp_path / "tiny.gguf")
    quant = QuantOptions(Quantization.GGUF, gguf_file=str(path))
    want = _load_then_quantize(tiny_llama, quant)
    spy = LoadSpy(monkeypatch)
    got = load_model(tiny_llama, torch.float32, CPU, 64, quant=quant)
    # only layer 1's float MLP ever had dense weights; the rest was never even read
    assert set().union(*spy.alive) == {1} and spy.alive[-1] == {1}
    projections = {n for n in spy.meta}
    assert len(projections) == 7 * LAYERS - 3 and not projections & floats
    assert _assert_same_layers(got, want) == 4 * LAYERS - 2
    assert not isinstance(got.layers[1].mlp.down_proj, QuantLinear)  # type: ignore[attr-defined]


def test_chunked_rtn_equals_the_whole_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantizing a few rows at a time gives the whole matrix's codes, scales and zeros."""
    w = torch.randn(100, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    monkeypatch.setattr(apply, "RTN_CHUNK_BYTES", 7 * 128 * 4)  # 7 rows a chunk, the last 2
    for method, bits, group in ((Quantization.INT4, 4, 32), (Quantization.INT8, 8, None)):
        got, err = apply.rtn_weight(w, method, group, "w")
        want = quantize_rtn(w, bits, 32 if bits == 4 else None)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        assert (got.zeros is None) == (want.zeros is None)
        assert got.zeros is None or torch.equal(got.zeros, want.zeros)  # type: ignore[arg-type]
        assert (got.bits, got.group_size) == (want.bits, want.group_size)
        assert err == pytest.approx(relative_error(w, want), rel=1e-6)
