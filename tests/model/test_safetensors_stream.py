"""``save_streaming`` writes files safetensors reads back exactly, one tensor at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvserve.model.safetensors_stream import save_streaming


def test_round_trip_every_dtype(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=g),  # 60 bytes: the next one starts unaligned
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "d": torch.randn(4, 4, generator=g).double().t(),  # not contiguous
    }
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "m.safetensors"
    save_streaming(path, specs, iter(tensors.items()), {"format": "pt"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_tensor_unlike_its_spec_is_refused(tmp_path: Path) -> None:
    specs = [("a", torch.float32, (2, 2))]
    with pytest.raises(ValueError, match="does not match its header entry"):
        save_streaming(tmp_path / "m.safetensors", specs, [("a", torch.zeros(2, 3))], {})
    with pytest.raises(ValueError):  # one tensor short
        save_streaming(tmp_path / "n.safetensors", specs, [], {})
