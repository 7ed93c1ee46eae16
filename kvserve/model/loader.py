"""Load a Hugging Face model folder (config.json + safetensors) into kvserve's model.

Only safetensors are read: pickle checkpoints (``*.bin``) and remote code are refused, since
loading them can execute arbitrary code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from kvserve.model.gemma import GemmaForCausalLM
from kvserve.model.llama import LlamaForCausalLM, attention_supports
from kvserve.model.packed_linear import FLOAT32_PACKED, pack_linears, packing_supported


def load_hf_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder: config.json is missing")
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise ValueError(f"{path} has only pickle checkpoints; kvserve loads safetensors only")
        raise ValueError(f"no *.safetensors weights in {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wanted = set(json.loads(index.read_text())["weight_map"].values())
        files = [f for f in files if f.name in wanted]
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The native class for ``config.architectures[0]`` (a minimal dispatch; the model
    registry replaces it)."""
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    for cls in (LlamaForCausalLM, GemmaForCausalLM):
        if arch in cls.architectures:
            return cls
    supported = LlamaForCausalLM.architectures + GemmaForCausalLM.architectures
    raise ValueError(f"unsupported architecture {arch!r}; kvserve runs {supported}")


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    max_positions: int,
    prepack: bool = False,
    fused_ops: bool = False,
) -> LlamaForCausalLM:
    """Build the model for ``max_positions`` tokens of context and load its weights."""
    path = Path(path)
    config = load_hf_config(path)
    # Build on the meta device: random init of weights that are overwritten anyway costs
    # seconds. Then allocate real (uninitialised) storage and load every weight into it.
    with torch.device("meta"):
        model = model_class(config)(config, max_positions)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    model.rotary.to_device(device)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(_iter_safetensors(path))
    if prepack and packing_supported(torch.device(device), dtype):
        pack_linears(model, only=FLOAT32_PACKED if dtype == torch.float32 else None)
    if fused_ops:
        model.enable_fused_ops()
    model.eval()
    return model


# Architectures whose native classes apply the config's sliding windows (layer_types).
_WINDOWED = ("Qwen3ForCausalLM", *GemmaForCausalLM.architectures)


def model_max_len(config: PretrainedConfig) -> int:
    """The context length the checkpoint supports (a sliding window, if any, caps it)."""
    max_len = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", True)
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch in _WINDOWED and attention_supports("sliding_window"):
        return max_len  # these models apply their windows in attention
    if window and use_window:
        # kvserve attends over the full context, so it stays inside the window to stay exact.
        max_len = min(max_len, int(window))
    return max_len
