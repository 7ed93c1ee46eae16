"""The transformers backend as a model: which class runs a checkpoint, the refusals (one per
reason, exact messages), the interface both kinds of model offer, the load-time probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvserve.config import ModelImpl
from kvserve.model.base import CausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_hf_config, load_model
from kvserve.model.registry import resolve_model_class
from kvserve.model.transformers_backend import (
    TransformersForCausalLM,
    paged_attention_forward,
)
from tests.model.tiny_hf import COMMON, make_config, make_tiny_hf_model, save_model

PREFIX = "cannot run {} through the transformers backend: "


def load(path: Path, max_positions: int = 512, impl: str = "transformers") -> CausalLM:
    return load_model(path, torch.float32, "cpu", max_positions, model_impl=impl)


def test_resolve_model_class() -> None:
    llama, phi3 = make_config("llama"), make_config("phi3")
    llama.architectures, phi3.architectures = ["LlamaForCausalLM"], ["Phi3ForCausalLM"]
    assert resolve_model_class(llama, ModelImpl.AUTO) is LlamaForCausalLM
    assert resolve_model_class(llama, "kvserve") is LlamaForCausalLM
    assert resolve_model_class(llama, "transformers") is TransformersForCausalLM
    assert resolve_model_class(phi3, "auto") is TransformersForCausalLM
    with pytest.raises(ValueError) as e:
        resolve_model_class(phi3, "kvserve")
    assert str(e.value) == (
        "model_impl='kvserve': Phi3ForCausalLM has no native kvserve implementation (native: "
        "Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM, GptOssForCausalLM, "
        "LlamaForCausalLM, "
        "MistralForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, Qwen2ForCausalLM, "
        "Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM); use model_impl='auto' "
        "or 'transformers' to run it through the transformers backend"
    )


def test_both_kinds_satisfy_the_model_protocol(tmp_path: Path) -> None:
    make_tiny_hf_model("llama", tmp_path)
    native, backend = load(tmp_path, impl="kvserve"), load(tmp_path)
    assert isinstance(native, LlamaForCausalLM) and isinstance(backend, TransformersForCausalLM)
    for model in (native, backend):
        assert isinstance(model, CausalLM)
        assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
        assert not model.fused_ops_enabled  # float32: no fused ops on either
    assert not backend.enable_fused_ops()


def test_geometry_of_multi_head_models(tmp_path: Path) -> None:
    """GPT-J names its sizes n_head / n_layer and has no num_key_value_heads."""
    make_tiny_hf_model("gptj", tmp_path)
    model = load(tmp_path)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 4, 16)


def _refusal(tmp_path: Path, config: transformers.PretrainedConfig, **kw: object) -> str:
    save_model(config, tmp_path)
    with pytest.raises(ValueError) as e:
        load(tmp_path, **kw)  # type: ignore[arg-type]
    return str(e.value)


def test_refuses_attention_outside_the_interface(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, transformers.StableLmConfig(**COMMON))
    assert msg == PREFIX.format("StableLmForCausalLM") + (
        "its attention does not go through transformers' attention interface "
        "(_supports_attention_backend is False)"
    )


def test_windows_and_soft_caps_reach_paged_attention() -> None:
    """A layer's window and attention soft-cap, as transformers passes them to the attention
    function, go to paged attention (the engine tests hold the outputs to transformers'); a
    window as long as the context is dropped, since it changes no score."""
    from types import SimpleNamespace

    from kvserve.model.transformers_backend import PagedStep, _attention_options

    cfg = make_config("gemma2")
    cfg.architectures = ["Gemma2ForCausalLM"]
    step = PagedStep(None, cfg, 512)  # type: ignore[arg-type]
    layer = SimpleNamespace(layer_idx=0, is_causal=True)
    options = _attention_options(layer, {"sliding_window": 8, "softcap": 1.0}, step)  # type: ignore[arg-type]
    assert options == {"sliding_window": 8, "soft_cap": 1.0}
    options = _attention_options(layer, {"sliding_window": 512, "softcap": None}, step)  # type: ignore[arg-type]
    assert options == {"sliding_window": None, "soft_cap": None}


def test_passes_attention_sinks_and_refuses_bidirectional_layers() -> None:
    """gpt-oss's sinks (``s_aux``) go to the backend as ``sinks``; what paged attention lacks
    is refused at the layer that asks for it (the load-time probe runs every layer once): an
    encoder-style non-causal layer."""
    from types import SimpleNamespace

    import torch

    from kvserve.model.transformers_backend import PagedStep, _attention_options

    cfg = make_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    step = PagedStep(None, cfg, 512)  # type: ignore[arg-type]
    prefix = "cannot run LlamaForCausalLM through the transformers backend: layer 1 "
    causal = SimpleNamespace(layer_idx=1, is_causal=True)
    sinks = torch.zeros(4)
    options = _attention_options(causal, {"s_aux": sinks}, step)  # type: ignore[arg-type]
    assert options["sinks"] is sinks
    for layer, kw in (
        (SimpleNamespace(layer_idx=1, is_causal=False), {}),
        (causal, {"is_causal": False}),
    ):
        with pytest.raises(ValueError) as e:
            _attention_options(layer, kw, step)  # type: ignore[arg-type]
        assert str(e.value) == prefix + "attends bidirectionally (is_causal=False)"


def test_refuses_models_without_attention(tmp_path: Path) -> None:
    cfg = transformers.MambaConfig(vocab_size=260, hidden_size=64, num_hidden_layers=2)
    assert _refusal(tmp_path, cfg) == PREFIX.format("MambaForCausalLM") + (
        "it has layers without attention (linear_attention); kvserve's KV cache holds "
        "attention K/V only"
    )


def test_refuses_encoder_decoder(tmp_path: Path) -> None:
    cfg = transformers.T5Config(vocab_size=260, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as e:
        load(tmp_path, impl="auto")
    assert str(e.value) == PREFIX.format("T5ForConditionalGeneration") + (
        "it is an encoder-decoder model; kvserve runs decoder-only causal language models"
    )


REMOTE = (
    "its config has an auto_map (trust_remote_code model); kvserve never runs a model's own "
    "Python code"
)


def test_refuses_remote_code(tmp_path: Path) -> None:
    """A known model type with an auto_map: transformers' class would not be the model's own;
    an unknown type needs the remote code to even read its config."""
    make_tiny_hf_model("phi3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    with pytest.raises(ValueError) as e:
        load(tmp_path, impl="auto")
    assert str(e.value) == PREFIX.format("Phi3ForCausalLM") + REMOTE
    custom = {**config, "auto_map": auto_map, "model_type": "custom-lm"}
    custom["architectures"] = ["CustomForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(custom))
    with pytest.raises(ValueError) as e:
        load_hf_config(tmp_path)
    assert str(e.value) == PREFIX.format("CustomForCausalLM") + REMOTE


def test_probe_catches_logits_post_processing(tmp_path: Path) -> None:
    """Granite divides its logits by logits_scaling; a wrapper that did not would be caught."""
    make_tiny_hf_model("granite", tmp_path)
    model = load(tmp_path)
    assert isinstance(model, TransformersForCausalLM)
    model.check_logits()  # the real post-processing passes
    model.logits_scaling = None
    with pytest.raises(ValueError, match="its forward post-processes the logits in a way"):
        model.check_logits()


def test_attention_function_needs_the_engine_step(tmp_path: Path) -> None:
    """Called without kvserve's step (as a stray generate() would), it says so."""
    make_tiny_hf_model("qwen3", tmp_path)
    model = load(tmp_path)
    assert isinstance(model, TransformersForCausalLM)
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(RuntimeError, match="runs inside kvserve's engine only"):
        paged_attention_forward(model.hf.model.layers[0].self_attn, q, q, q, None)


def test_importing_kvserve_leaves_transformers_modeling_code_out() -> None:
    """The registry imports the backend only for a model that runs on it: transformers'
    modeling code costs every server, rank and CLI start ~3 s of CPU (architectures.py)."""
    code = (
        "import sys, kvserve, kvserve.cli, kvserve.server.app, kvserve.model.loader; "
        "print(sorted(m for m in ('transformers.modeling_utils', "
        "'kvserve.model.transformers_backend') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
