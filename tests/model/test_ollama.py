"""Models from Ollama's store (``ollama:name:tag``): a store laid out as ``ollama pull``
writes it (manifests by registry/namespace/model/tag, blobs named by their sha256), whose
model layer is the built-in SmolLM2 GGUF, so the converted folder is the built-in one's."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.model import ollama
from kvserve.model.builtin import builtin_model_path, find_builtin_gguf

PARAMS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repeat_penalty": 1.1,
          "num_predict": 7, "stop": ["<|im_end|>"], "num_ctx": 4096}  # fmt: skip


def _blob(root: Path, data: bytes | None = None, src: Path | None = None) -> dict[str, Any]:
    """Write a blob as Ollama names it; returns its manifest layer entry (less mediaType)."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    if src is not None:
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, root / "blobs" / f"sha256-{digest}")
        size = src.stat().st_size
    else:
        assert data is not None
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        size = len(data)
    return {"digest": f"sha256:{digest}", "size": size}


def write_store(root: Path, name: str, tag: str, extra_layers: list[dict[str, Any]] = ()) -> Path:
    """A store holding ``name:tag`` = the built-in GGUF + PARAMS + a Go template layer."""
    layers = [
        {"mediaType": ollama.MODEL_LAYER, **_blob(root, src=find_builtin_gguf())},
        {"mediaType": "application/vnd.ollama.image.template",
         **_blob(root, b"{{ .System }}{{ .Prompt }}")},
        {"mediaType": ollama.PARAMS_LAYER, **_blob(root, json.dumps(PARAMS).encode())},
        *extra_layers,
    ]  # fmt: skip
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return manifest


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ollama-models")
    write_store(root, "smollm2", "135m")
    return root


def test_names_map_to_manifest_paths(tmp_path: Path) -> None:
    lib = tmp_path / "manifests" / "registry.ollama.ai"
    assert ollama.manifest_path("qwen3", tmp_path) == (lib / "library/qwen3/latest", "qwen3:latest")
    assert ollama.manifest_path("qwen3:4b", tmp_path) == (lib / "library/qwen3/4b", "qwen3:4b")
    assert ollama.manifest_path("me/m:q4", tmp_path) == (lib / "me/m/q4", "me/m:q4")
    host = tmp_path / "manifests" / "hf.co" / "org" / "m" / "Q4_K_M"
    assert ollama.manifest_path("hf.co/org/m:Q4_K_M", tmp_path) == (host, "hf.co/org/m:Q4_K_M")
    for bad in ("", "a/b/c/d", "../x", "x:../y"):
        with pytest.raises(ValueError, match="is not an Ollama model name"):
            ollama.manifest_path(bad, tmp_path)


def test_resolves_the_model_blob_and_params(store: Path) -> None:
    found = ollama.resolve_ollama("ollama:smollm2:135m", store)
    assert found.name == "smollm2:135m" and found.gguf.parent == store / "blobs"
    assert found.params == PARAMS
    assert found.sampling_defaults() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                         "repetition_penalty": 1.1, "max_tokens": 7}  # fmt: skip
    # the same content as the built-in wheel's GGUF: the same conversion, not a second one
    assert ollama.resolve_ollama(str(found.manifest), store) == found
    args = EngineArgs(model="ollama:smollm2:135m")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_MODELS", str(store))
        folder, name, gguf, defaults = args._resolve_model()
    assert (folder, name, gguf) == (builtin_model_path(), "smollm2:135m", str(found.gguf))
    assert defaults == found.sampling_defaults()


def test_refusals(tmp_path: Path, store: Path) -> None:
    with pytest.raises(ValueError, match=r"smollm2:7b is not in the store .*ollama pull"):
        ollama.resolve_ollama("ollama:smollm2:7b", store)
    adapter = {"mediaType": "application/vnd.ollama.image.adapter", **_blob(tmp_path, b"x")}
    manifest = write_store(tmp_path, "tuned", "latest", [adapter])
    with pytest.raises(ValueError, match="tuned:latest has a LoRA adapter layer"):
        ollama.resolve_ollama("ollama:tuned", tmp_path)
    layers = json.loads(manifest.read_text())["layers"]
    layers[0]["size"] += 1
    manifest.write_text(json.dumps({"layers": layers[:1]}))
    with pytest.raises(ValueError, match=r"the manifest says .* partial pull"):
        ollama.resolve_ollama("ollama:tuned", tmp_path)
    layers[0]["digest"] = "sha256:" + "0" * 64
    manifest.write_text(json.dumps({"layers": layers[:1]}))
    with pytest.raises(ValueError, match=r"model blob .* is missing"):
        ollama.resolve_ollama("ollama:tuned", tmp_path)


@pytest.mark.slow
def test_llm_serves_it_with_its_params_as_defaults(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens equal the built-in model's; the params layer's values are the defaults
    (num_predict 7 -> 7 tokens when the request sets no max_tokens)."""
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    llm = LLM("ollama:smollm2:135m", kv_cache_memory="64MiB", max_model_len=512)
    assert llm.engine.config.model.served_name == "smollm2:135m"
    assert llm.engine.default_sampling_params["max_tokens"] == 7
    greedy = SamplingParams(temperature=0, max_tokens=8)
    got = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    ref = LLM(None, kv_cache_memory="64MiB", max_model_len=512)
    want = ref.generate(["The capital of France is"], greedy, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.slow
def test_gemma3_as_ollama_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gemma3 blob from Ollama's converter (``ollama pull gemma3``): the vision tower in the
    same file, the local RoPE base under Ollama's key, the window pattern per layer (here not
    transformers' default: layer 2 global too). Served as text with transformers' greedy
    tokens on the same weights and settings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.model.test_gguf_families import kvserve_greedy, transformers_greedy
    from tests.model.test_gguf_gemma_phi3 import PROMPTS, make_model
    from tests.model.test_gguf_gemma_phi3 import write_gguf as write_gemma

    made = make_model("gemma3")
    layer_types = ["sliding_attention"] * 6
    layer_types[2] = layer_types[5] = "full_attention"
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0}}  # fmt: skip
    config = Gemma3TextConfig(**{**made.config.to_dict(), "layer_types": layer_types,
                                 "rope_parameters": rope})  # fmt: skip
    original = Gemma3ForCausalLM(config).eval()
    original.load_state_dict(made.state_dict())
    blob = write_gemma(original, "gemma3", tmp_path / "gemma3.gguf", ollama=True)
    store = tmp_path / "store"
    layers = [{"mediaType": ollama.MODEL_LAYER, **_blob(store, src=blob)}]
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "gemma3" / "tiny"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got = kvserve_greedy("ollama:gemma3:tiny", PROMPTS)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == transformers_greedy(original, prompt), prompt
    assert len({t[0] for t in got}) > 1  # not one repeated token
