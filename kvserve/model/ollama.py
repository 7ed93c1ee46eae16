"""Models from Ollama's local store: ``kvserve serve ollama:qwen3:4b``.

Ollama keeps what ``ollama pull`` fetched under ``$OLLAMA_MODELS`` (default
``~/.ollama/models``) as an OCI-style registry: a manifest per ``name:tag`` at
``manifests/<registry>/<namespace>/<name>/<tag>`` lists layers by digest, and each layer is a
file ``blobs/sha256-<hex>``. The ``application/vnd.ollama.image.model`` layer is a plain GGUF
file (llama.cpp's format), so kvserve serves it as it serves any ``.gguf``; the ``params``
layer (JSON: ``temperature``, ``top_k``, ``stop``, ...) becomes the model's default sampling
values, as a checkpoint's ``generation_config.json`` does (``--generation-config auto``).

Not taken from the store: the ``template`` layer is a Go template (Ollama's own engine), so
chat prompts use the GGUF's Jinja ``tokenizer.chat_template`` (llama.cpp's converter writes
it) or ``--chat-template``; ``stop`` strings are logged, not applied (the GGUF's EOS/EOT ids end
turns; a request can still send ``stop``). Adapter and projector (vision) layers are refused
by name. Nothing is downloaded: a model that is not in the store is an error saying so.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvserve")

PREFIX = "ollama:"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
# Layers whose meaning kvserve cannot honour: refused by name rather than dropped.
REFUSED_LAYERS = {
    "application/vnd.ollama.image.adapter": "a LoRA adapter layer (serve the base GGUF and "
    "give the adapter with --lora-modules as a PEFT folder)",
    "application/vnd.ollama.image.projector": "a vision projector layer (multimodal models are "
    "not supported)",
}
# Ollama's params name -> the SamplingParams field it is the default of.
PARAM_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": "max_tokens",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class OllamaModel:
    """One ``name:tag`` of the store, resolved to its files."""

    name: str  # Ollama's own spelling, "qwen3:4b" (served under it)
    manifest: Path
    gguf: Path  # the model layer's blob: a GGUF file without the .gguf suffix
    digest: str  # the model layer's "sha256:<hex>": its content identity
    params: dict[str, Any] = field(default_factory=dict)  # the params layer, Ollama's names

    @property
    def content_id(self) -> str:
        """The blob's hash in the form a wheel's RECORD writes it (``sha256=<base64url>``),
        so a blob holding the built-in GGUF shares its one-time conversion."""
        raw = bytes.fromhex(self.digest.split(":", 1)[1])
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    def sampling_defaults(self) -> dict[str, Any]:
        """SamplingParams field -> the params layer's value (``num_predict`` <= 0 is
        Ollama's "no limit", so it sets nothing)."""
        out = {f: self.params[k] for k, f in PARAM_FIELDS.items() if k in self.params}
        if "max_tokens" in out and int(out["max_tokens"]) <= 0:
            del out["max_tokens"]
        return out


def models_dir() -> Path:
    """Ollama's store: ``$OLLAMA_MODELS`` as Ollama reads it, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def is_ollama_ref(model: str) -> bool:
    return model.startswith(PREFIX)


def manifest_path(ref: str, root: Path) -> tuple[Path, str]:
    """``ref`` (``qwen3``, ``qwen3:4b``, ``user/model:tag``, ``host/ns/model:tag``) -> its
    manifest path and Ollama's display name. A bad name raises ValueError."""
    name, _, tag = ref.partition(":")
    tag = tag or "latest"
    parts = name.split("/")
    if not 1 <= len(parts) <= 3 or not all(_NAME.fullmatch(p) for p in [*parts, tag]):
        raise ValueError(f"{PREFIX}{ref!r} is not an Ollama model name (name[:tag], "
                         "namespace/name[:tag] or registry/namespace/name[:tag])")  # fmt: skip
    defaults = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE]
    registry, namespace, model = [*defaults[: 3 - len(parts)], *parts]
    shown = f"{model}:{tag}" if len(parts) == 1 else f"{name}:{tag}"
    return root / "manifests" / registry / namespace / model / tag, shown


def blob_path(root: Path, digest: str) -> Path:
    """A layer's file: ``blobs/sha256-<hex>`` (older stores: ``sha256:<hex>``)."""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ValueError(f"Ollama layer digest {digest!r} is not sha256:<64 hex digits>")
    dashed = root / "blobs" / digest.replace(":", "-")
    return dashed if dashed.exists() or not (root / "blobs" / digest).exists() else (
        root / "blobs" / digest
    )  # fmt: skip


def read_manifest(manifest: Path, name: str, root: Path) -> OllamaModel:
    """The model and params layers of one manifest; refuses what kvserve cannot serve."""
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        layers = list(doc["layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Ollama manifest {manifest} is not readable: {e}") from e
    by_type: dict[str, dict[str, Any]] = {}
    for layer in layers:
        kind = str(layer.get("mediaType", ""))
        if kind in REFUSED_LAYERS:
            raise ValueError(f"Ollama model {name} has {REFUSED_LAYERS[kind]}; kvserve does "
                             "not serve it")  # fmt: skip
        by_type.setdefault(kind, layer)
    if MODEL_LAYER not in by_type:
        raise ValueError(f"Ollama manifest {manifest} has no model layer ({MODEL_LAYER})")
    model = by_type[MODEL_LAYER]
    gguf = blob_path(root, str(model.get("digest", "")))
    if not gguf.is_file():
        raise ValueError(f"Ollama model {name}: its model blob {gguf} is missing (a partial "
                         f"pull? run `ollama pull {name}` again)")  # fmt: skip
    if "size" in model and gguf.stat().st_size != int(model["size"]):
        raise ValueError(f"Ollama model {name}: blob {gguf} has {gguf.stat().st_size} bytes, "
                         f"the manifest says {model['size']} (a partial pull?)")  # fmt: skip
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"Ollama model {name}: blob {gguf} is not a GGUF file")
    params: dict[str, Any] = {}
    if PARAMS_LAYER in by_type:
        path = blob_path(root, str(by_type[PARAMS_LAYER].get("digest", "")))
        params = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(params, dict):
            raise ValueError(f"Ollama model {name}: params blob {path} is not a JSON object")
    return OllamaModel(name, manifest, gguf, str(model["digest"]), params)


def resolve_ollama(model: str, root: Path | None = None) -> OllamaModel:
    """``ollama:<name>[:tag]``, or a path to a manifest file inside a store, -> the model."""
    root = models_dir() if root is None else root
    if is_ollama_ref(model):
        manifest, name = manifest_path(model[len(PREFIX) :], root)
        if not manifest.is_file():
            raise ValueError(f"Ollama model {name} is not in the store at {root} (no "
                             f"{manifest}); pull it with `ollama pull {name}` or set "
                             "$OLLAMA_MODELS; kvserve downloads nothing")  # fmt: skip
        return read_manifest(manifest, name, root)
    manifest = Path(model).expanduser().resolve()
    store = manifest.parents[4]  # <store>/manifests/<registry>/<ns>/<model>/<tag>
    name = f"{manifest.parent.name}:{manifest.name}"
    return read_manifest(manifest, name, store)


def is_manifest_path(model: str) -> bool:
    """A file under ``.../manifests/<registry>/<namespace>/<model>/<tag>``."""
    path = Path(model).expanduser()
    parents = path.resolve().parents if path.is_file() else []
    return len(parents) > 4 and parents[3].name == "manifests"


def log_unapplied(model: OllamaModel) -> None:
    """Say which params were not taken over, so none is silently dropped."""
    rest = sorted(set(model.params) - set(PARAM_FIELDS))
    if rest:
        logger.info("Ollama params of %s not applied: %s (stop strings: the GGUF's EOS/EOT ids "
                    "end turns; context size: --max-model-len)", model.name,
                    {k: model.params[k] for k in rest})  # fmt: skip
