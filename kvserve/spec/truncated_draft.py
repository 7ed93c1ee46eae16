"""A draft model made from the target itself: its first layers, its embeddings and LM head.

A truncated copy shares the tokenizer and, because it is the target's own early layers with
the target's final norm and LM head (an early exit, as in LayerSkip's self-speculation), it
agrees with the target more than an unrelated small model would, with no training. It is a
normal model folder, so ``speculative_config={"method": "draft_model", "model": folder}``
loads it like any other draft.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvserve.model.gguf_convert import GGUF_WEIGHTS_FILE, iter_gguf_weights, weights_in_gguf

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated_draft(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Copy the Hugging Face model folder ``src`` to ``dst`` with its first ``num_layers``
    decoder layers only (config, tokenizer and the other weights unchanged)."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}] for {src}, got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in _weights(src):
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors")
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen2, ...)
        config["layer_types"] = config["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name not in _NOT_COPIED and file.is_file():
            shutil.copy(file, dst / file.name)
    return dst


# config.json is rewritten; a large GGUF's folder names its GGUF, whose weights the copy holds
_NOT_COPIED = ("config.json", GGUF_WEIGHTS_FILE)


def _weights(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the folder ``src``: its safetensors, or a large GGUF's tensors."""
    if weights_in_gguf(src) is not None:
        yield from iter_gguf_weights(src)
        return
    for file in sorted(src.glob("*.safetensors")):
        yield from load_file(file).items()
