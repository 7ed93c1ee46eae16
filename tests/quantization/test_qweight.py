"""Round-to-nearest quantization and the QuantizedWeight format."""

from __future__ import annotations

import pytest
import torch

from kvserve.quantization.qweight import (
    QuantizedWeight,
    concat_rows,
    quantize_rtn,
    relative_error,
)


def test_int8_per_channel_round_trip_is_within_half_a_step() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    qw = quantize_rtn(w, 8, None)
    assert qw.group_size == 64 and qw.scales.shape == (48, 1)
    assert qw.scales.dtype == torch.float16 and qw.zeros is None
    assert int(qw.codes.abs().max()) == 127  # each row's largest weight takes the top code
    step = qw.scales.float().repeat_interleave(64, dim=1)
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_int4_uses_llama_cpp_q4_1_rule() -> None:
    # one group [-1, 2, 0.5, 14]: scale = (14 - -1) / 15 = 1, zero = -1
    w = torch.tensor([[-1.0, 2.0, 0.5, 14.0]])
    qw = quantize_rtn(w, 4, 4)
    assert qw.scales.tolist() == [[1.0]] and qw.zeros is not None and qw.zeros.tolist() == [[-1.0]]
    assert qw.codes.tolist() == [[0, 3, 2, 15]]  # 1.5 rounds to even: 2
    assert qw.dequantize().tolist() == [[-1.0, 2.0, 1.0, 14.0]]


def test_int4_symmetric_uses_llama_cpp_q4_0_rule() -> None:
    # one group [-4, 1, 2, 3]: the largest magnitude is -4, so scale = -4 / -8 = 0.5
    w = torch.tensor([[-4.0, 1.0, 2.0, 3.0]])
    qw = quantize_rtn(w, 4, 4, symmetric=True)
    assert qw.scales.tolist() == [[0.5]] and qw.zeros is None
    assert qw.codes.tolist() == [[-8, 2, 4, 6]]
    assert torch.equal(qw.dequantize(), w)
    # a positive maximum gets a negative scale; +8 is clamped to 7
    qw = quantize_rtn(torch.tensor([[4.0, -4.0, 1.0, 0.0]]), 4, 4, symmetric=True)
    assert qw.scales.tolist() == [[-0.5]] and qw.codes.tolist() == [[-8, 7, -2, 0]]


def test_int4_recovers_q4_1_values() -> None:
    """Weights that are already Q4_1 values (the built-in model's) come back exactly."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    codes[:, ::32] = 0  # every group holds its lowest and highest code
    codes[:, 1::32] = 15
    d = (torch.rand(16, 2, generator=g) * 0.1).half().float()
    m = (torch.randn(16, 2, generator=g) * 0.1).half().float()
    w = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    qw = quantize_rtn(w, 4, 32)
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=2e-3)


def test_zero_group_gives_zero_codes() -> None:
    for sym in (True, False):
        qw = quantize_rtn(torch.zeros(16, 32), 4, 32, symmetric=sym)
        assert int(qw.codes.abs().max()) == 0
        assert torch.equal(qw.dequantize(), torch.zeros(16, 32))


@pytest.mark.parametrize(("bits", "group", "bound"), [(8, None, 0.01), (4, 32, 0.15)])
def test_relative_error_of_gaussian_weights(bits: int, group: int | None, bound: float) -> None:
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    err = relative_error(w, quantize_rtn(w, bits, group))
    assert 0 < err < bound


@pytest.mark.parametrize("group", [0, 3, 48, 100])
def test_bad_group_size_is_refused(group: int) -> None:
    with pytest.raises(ValueError, match=f"group size {group} must be even and divide"):
        quantize_rtn(torch.randn(16, 64), 4, group)


def test_bad_bits_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize_rtn(torch.randn(16, 64), 2, 32)
    with pytest.raises(ValueError, match="do not fit 16 x 64 weights in groups of 32"):
        QuantizedWeight(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 4), None, 4, 32)


def test_concat_rows_keeps_values_across_groups_and_zero_points() -> None:
    g = torch.Generator().manual_seed(2)
    a = quantize_rtn(torch.randn(16, 64, generator=g), 4, 32, symmetric=True)  # no zeros
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.int8)
    b = QuantizedWeight(codes, torch.rand(32, 4), torch.randn(32, 4), 4, 16)  # [0, 15] + zero
    c = concat_rows([a, b])
    assert c.group_size == 16 and c.bits == 4 and c.zeros is not None
    assert c.scales.dtype == torch.float32
    torch.testing.assert_close(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    # same range everywhere: exact
    d = concat_rows([a, a])
    assert torch.equal(d.dequantize(), torch.cat([a.dequantize()] * 2)) and d.zeros is None
