"""The oneDNN-prepacked linear fast path gives the same numbers as nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model.packed_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 packing"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130, 300])
def test_packed_equals_reference(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    ref = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(ref)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert torch.equal(packed(x), ref(x))
    x3 = torch.randn(2, rows, 96, dtype=torch.bfloat16)  # leading dims are kept
    assert packed(x3).shape == (2, rows, 200)
    assert torch.equal(packed(x3), ref(x3))


def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model(x), expected)


def test_not_supported_for_float32() -> None:
    assert not packing_supported(torch.device("cpu"), torch.float32)
