"""A pre-quantized checkpoint's projections (compressed-tensors, AWQ, GPTQ), read one fused
module at a time while the model loads, as ``gguf_weights.GGUFLinears`` reads a GGUF's.

Dequantizing the whole checkpoint first and quantizing the layers again held every
projection's float32 weight at once: 4 bytes a weight, 28 GB for a 7B model whose int4
checkpoint is 4 GB. Here the loader's stream never reads a quantized tensor
(``checkpoint_names``), ``load_weights`` gets a meta weight of the right shape for each
quantized projection (``meta_weights``), and ``StreamingQuantizer`` takes each fused module's
codes from ``take`` once its ``PendingLinear`` has its bias.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.quantization import gptq
from kvserve.quantization.compressed_tensors import (
    AWQ,
    WeightScheme,
    part_weight,
    quantized_tensors,
)
from kvserve.quantization.fusion import fuse_projections, fused_modules
from kvserve.quantization.qweight import QuantizedWeight


class CheckpointLinears:
    """``modules``: kvserve module path (``layers.3.self_attn.qkv_proj``) -> its parts
    (``layers.3.self_attn.q_proj``, ...); ``checkpoint_names``: every quantized tensor of
    the checkpoint (the loader's stream drops them)."""

    def __init__(self, files: list[Path], scheme: WeightScheme) -> None:
        self.scheme = scheme
        self._file: dict[str, Path] = {}  # tensor name -> its file
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                self._file.update(dict.fromkeys(f.keys(), file))
        self._parts = quantized_tensors(set(self._file), scheme)  # model.<module> -> leaves
        projections = [m.removeprefix("model.") for m in self._parts if not m.endswith("lm_head")]
        self.modules = fused_modules(projections)
        self.checkpoint_names = {n for leaves in self._parts.values() for n in leaves.values()}

    def take(self, module: str) -> QuantizedWeight:
        """``module``'s weight: its parts read, unpacked and fused."""
        parts = {p: self._read(f"model.{p}") for p in self.modules[module]}
        return fuse_projections(parts)[module]

    def meta_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What ``load_weights`` gets in place of the quantized tensors: a meta ``weight`` of
        each quantized projection's shape (never read), and quantized modules that are not
        projections (an LM head) dequantized."""
        for module, leaves in self._parts.items():
            if module.endswith("lm_head"):
                yield f"{module}.weight", self._read(module).dequantize(torch.float32)
            else:
                yield f"{module}.weight", torch.empty(self._shape(leaves), device="meta")

    def _read(self, module: str) -> QuantizedWeight:
        leaves = self._parts[module]
        params = {}
        for leaf, name in leaves.items():
            with safe_open(str(self._file[name]), framework="pt") as f:
                params[leaf] = f.get_tensor(name)  # a copy: the map closes with the block
        return part_weight(params, self.scheme, module)

    def _shape(self, leaves: dict[str, str]) -> tuple[int, int]:
        """A projection's ``[N, K]`` from its tensors' shapes (only ``weight_shape``, 2
        numbers, is read)."""

        def shape(leaf: str) -> list[int]:
            with safe_open(str(self._file[leaves[leaf]]), framework="pt") as f:
                return list(f.get_slice(leaves[leaf]).get_shape())

        if self.scheme.format in gptq.FORMATS:  # qweight [K * bits / 32, N]
            rows, n = shape("qweight")
            return n, rows * 32 // self.scheme.bits
        if self.scheme.format == AWQ:  # qweight [K, N / 8]
            k, cols = shape("qweight")
            return cols * 8, k
        if "weight_shape" in leaves:
            with safe_open(str(self._file[leaves["weight_shape"]]), framework="pt") as f:
                n, k = (int(v) for v in f.get_tensor(leaves["weight_shape"]).tolist())
            return n, k
        n, k = shape("weight")
        return n, k
