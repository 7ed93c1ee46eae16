"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` takes every tensor at once; converting a GGUF into a float32
folder that way held the whole model in float32 (a TinyLlama-1.1B-shaped model: 4.4 GB). The
format only needs each tensor's name, dtype, shape and byte range up front (a JSON header after
its 8-byte little-endian length), so the header is written from the shapes and each tensor's
bytes follow as they are produced.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16"}  # fmt: skip


def save_streaming(
    path: Path,
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
) -> None:
    """Write ``tensors`` (in the order of ``specs``: name, dtype, shape each) to ``path``,
    holding one at a time; a tensor that does not match its spec is a ``ValueError``."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for (name, tensor), spec in zip(tensors, specs, strict=True):
            if (name, tensor.dtype, tuple(tensor.shape)) != spec:
                raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not "
                                 f"match its header entry {spec}")  # fmt: skip
            f.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
