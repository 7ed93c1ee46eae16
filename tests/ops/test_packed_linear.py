"""The oneDNN-prepacked linear fast path gives the same numbers as nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.ops.packed_linear import PackedLinear, pack_linears, packing_supported

needs_bf16 = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 packing"
)
needs_fp32 = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN packing"
)


@needs_bf16
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


@needs_bf16
def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model(x), expected)


@needs_fp32
@pytest.mark.parametrize("rows", [1, 8, 32, 300])
def test_packed_float32_is_close_to_the_reference(rows: int) -> None:
    """float32 packing sums in another order: equal within float32 rounding, not bit for bit."""
    torch.manual_seed(rows)
    ref = nn.Linear(576, 1000, bias=False)
    packed = PackedLinear(ref)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(packed(x), ref(x), rtol=1e-5, atol=1e-4)


@needs_fp32
def test_float32_packs_only_the_named_layers() -> None:
    model = nn.Module()
    model.lm_head = nn.Linear(8, 16)
    model.layer = nn.Module()
    model.layer.gate_up_proj = nn.Linear(8, 8)
    model.layer.down_proj = nn.Linear(8, 8)
    assert pack_linears(model, only=("lm_head", "gate_up_proj")) == 2
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.layer.gate_up_proj, PackedLinear)
    assert isinstance(model.layer.down_proj, nn.Linear)


def test_not_supported_off_cpu() -> None:
    assert not packing_supported(torch.device("meta"), torch.float32)
