"""Reads a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) and
checks it against the base model before anything reaches a device slot.

An adapter is refused with the reason (``LoRAAdapterError``, a ValueError: a 400 over HTTP)
when its files are missing or broken, its rank is above ``max_lora_rank``, it targets
modules the model lacks (embeddings, the LM head, DoRA, biases: not implemented), or a
tensor's shape differs from the base model's layer (an adapter trained on another base).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

# The projections an adapter may target, in the order of the fused layers' slices.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTN_MODULES + MLP_MODULES

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot run on this model; the message says why."""


@dataclass(frozen=True)
class LoRAModelDims:
    """The base model's layer sizes an adapter must match (whole model, not a TP shard)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # module -> (in_features, out_features)

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> LoRAModelDims:
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q, kv = heads * head_dim, int(config.num_key_value_heads) * head_dim
        inter = int(config.intermediate_size)
        shapes = {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }  # fmt: skip
        return cls(int(config.num_hidden_layers), shapes)


@dataclass(frozen=True)
class LoRAModel:
    """One adapter in host memory: per (layer, module) its A ``[r, in]`` and its B
    ``[out, r]`` with the scaling already folded in (B * alpha / r, or alpha / sqrt(r))."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    if not path.is_file():
        raise LoRAAdapterError(f"{str(folder)!r} has no adapter_config.json (not a PEFT folder)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{path}: adapter_config.json is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{path}: adapter_config.json is not a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, or the reason it cannot run here."""
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"peft_type {cfg.get('peft_type')!r}: kvserve runs LoRA adapters")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("modules_to_save", "fully trained modules (modules_to_save)")):  # fmt: skip
        if cfg.get(key):
            raise LoRAAdapterError(f"the adapter uses {what}, which kvserve does not support")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"the adapter trains biases (bias={cfg['bias']!r}); unsupported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(f"the adapter's rank {r} is above max_lora_rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(TARGET_MODULES))
        if lacking:
            raise LoRAAdapterError(
                f"the adapter targets modules the model lacks or kvserve does not adapt: "
                f"{lacking}; kvserve adapts {list(TARGET_MODULES)}"
            )
    return r, scaling


def load_peft_adapter(
    folder: str | Path, lora_int_id: int, dims: LoRAModelDims, max_rank: int, dtype: torch.dtype
) -> LoRAModel:
    """Read and check a PEFT folder; the tensors come back in ``dtype`` on the CPU."""
    folder = Path(folder).expanduser()
    cfg = read_adapter_config(folder)
    rank, scaling = _check_config(cfg, max_rank)
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        extra = (
            " (adapter_model.bin is not read: pickle)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise LoRAAdapterError(f"{str(folder)!r} has no adapter_model.safetensors{extra}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"{path}: cannot read the adapter's weights: {e}") from e
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise LoRAAdapterError(
                f"the adapter has weight {key!r}, for a module the model lacks or kvserve does "
                f"not adapt (kvserve adapts {list(TARGET_MODULES)})"
            )
        layer, module = int(m.group(1)), m.group(2)
        if layer >= dims.num_layers:
            raise LoRAAdapterError(
                f"weight {key!r}: layer {layer}, but the model has {dims.num_layers} layers "
                "(an adapter for another base model?)"
            )
        parts.setdefault((layer, module), {})[m.group(3)] = t
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        weights[(layer, module)] = _check_pair(layer, module, ab, dims, rank, scaling, dtype)
    if not weights:
        raise LoRAAdapterError(f"{path}: the adapter holds no LoRA weights")
    return LoRAModel(lora_int_id, rank, scaling, weights)


def _check_pair(
    layer: int,
    module: str,
    ab: dict[str, torch.Tensor],
    dims: LoRAModelDims,
    rank: int,
    scaling: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's (A [r, in], B * scaling [out, r]) after checking both shapes."""
    where = f"layers.{layer}.{module}"
    if set(ab) != {"A", "B"}:
        raise LoRAAdapterError(f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
    a, b = ab["A"], ab["B"]
    k, n = dims.shapes[module]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoRAAdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               "do not form a low-rank pair")  # fmt: skip
    if a.shape[0] != rank:
        raise LoRAAdapterError(f"{where}: rank {a.shape[0]}, but adapter_config.json says r={rank}")
    if a.shape[1] != k or b.shape[0] != n:
        raise LoRAAdapterError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
            f"model's {module} ({k} in, {n} out): an adapter for another base model?"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAAdapterError(f"{where}: LoRA weights must be floating point")
    # Scaling folded into B in float32, then one rounding to the model dtype.
    return a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()
