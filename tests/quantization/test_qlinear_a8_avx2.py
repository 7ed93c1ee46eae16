"""The AVX2 int8-activation path (``csrc/quant_linear_a8_avx2.h``: vpmaddubsw, float32 and bf16
activations) against its reference of the same math (``reference_linear_a8``), and against
the exact-activation ``reference_linear`` within the bound that quantizing x allows."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import QuantizedActivations
from kvserve.quantization.qlinear import (
    A8_NARROW,
    QuantLinear,
    _a8_avx2,
    _a8_kernel,
    exact_activations,
    quantize_activations,
    reference_linear,
)
from kvserve.quantization.qweight import QuantizedWeight
from tests.quantization.test_qlinear import _weights

CPU = torch.device("cpu")
INT8 = QuantizedActivations.INT8
needs_avx2 = pytest.mark.skipif(not _a8_avx2(), reason="needs the AVX2 build of the kernels")

CASES = [  # bits, group, zeros, float16 scales
    (8, 32, False, True),  # Q8_0
    (8, 128, True, False),
    (8, 16, False, False),  # Q6_K: two scales per block of 32
    (4, 32, False, True),  # int4 symmetric / Q4_0 (stored code + 8)
    (4, 32, True, True),  # int4 / Q4_1
    (4, 128, True, False),
    (4, 128, False, True),
    (4, 16, True, False),
]


def _exact(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x quantized as the kernel does, times the dequantized weight, in float64."""
    q, d = quantize_activations(x)
    return exact_activations(q, d) @ qw.exact().t()  # [M, N]


@needs_avx2
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_float32_equals_the_same_math(
    bits: int, group: int, zeros: bool, half: bool, rows: int
) -> None:
    # N = 80, 112, 208: not multiples of 64 (the kernel runs 16 channels at a time)
    for n in (80, 112, 208):
        qw = _weights(n, 512, bits, group, zeros, half)
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows + n))
        layer = QuantLinear(qw, None, CPU, torch.float32, INT8)
        assert layer.path == "a8"
        exact = _exact(x, qw)
        # float32 sums of exact int32 block products: a few ulps of the largest partial sum
        torch.testing.assert_close(
            layer(x).double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max())
        )


@needs_avx2
@pytest.mark.skipif(_a8_kernel(), reason="bf16 runs on the VNNI kernel here")
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
def test_bf16_on_avx2_equals_the_same_math(bits: int, group: int, zeros: bool, half: bool) -> None:
    qw = _weights(80, 256, bits, group, zeros, half)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(bits + group)).bfloat16()
    layer = QuantLinear(qw, None, CPU, torch.bfloat16, INT8)
    assert layer.path == "a8"
    exact = _exact(x, qw)
    bound = exact.abs() * 2.0**-8 + 1e-5 * float(exact.abs().max())  # bf16 output rounding
    assert bool(((layer(x).double() - exact).abs() <= bound).all())


@needs_avx2
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
def test_within_the_quantization_bound_of_reference_linear(
    bits: int, group: int, zeros: bool, half: bool
) -> None:
    """Against exact activations: each x_k moves by at most d_b / 2 = max|x_b| / 254 (its
    block's scale), so |y_n - y_n'| <= sum_k |W_nk| max|x_b(k)| / 254, plus float32 sums.
    Measured on these weights and N(0, 1) activations: the largest error 0.46% to 0.71% of
    max |y| (0.10 to 0.12 of its own bound; the median error 0.02 of it)."""
    qw = _weights(208, 512, bits, group, zeros, half)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(7))
    got = QuantLinear(qw, None, CPU, torch.float32, INT8)(x).double()
    want = reference_linear(x.double(), qw)  # [4, N] exact activations
    step = x.double().abs().reshape(4, 16, 32).amax(-1).repeat_interleave(32, 1) / 254  # [4, K]
    bound = step @ qw.exact().abs().t() + 1e-5 * float(want.abs().max())
    assert bool(((got - want).abs() <= bound).all())
    assert float((got - want).abs().max()) < 0.01 * float(want.abs().max())


@needs_avx2
@pytest.mark.parametrize(("bits", "zeros"), [(8, False), (4, False), (4, True)])
def test_integer_inputs_give_exact_products(bits: int, zeros: bool) -> None:
    """Unit scales and blocks whose largest |x| is 127: q = x and d = 1, every sum an exact
    integer, so the float32 output is exactly the integer product; int8 codes include -128
    (|-128| is 128 unsigned in the sign trick) and every block has negative activations."""
    n, k, rows = 32, 128, 4
    g = torch.Generator().manual_seed(bits)
    lo, hi = (-128, 128) if bits == 8 else ((0, 16) if zeros else (-8, 8))
    codes = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    if bits == 8:
        codes[:, :8] = -128
    scales = torch.ones(n, k // 32)
    z = torch.randint(-3, 4, (n, k // 32), generator=g).float() if zeros else None
    qw = QuantizedWeight(codes, scales, z, bits, 32)
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x[:, ::32] = 127.0  # every block's max: scale 1
    x[:, 1::32] = -127.0
    w = codes.double() + (0 if z is None else z.double().repeat_interleave(32, 1))
    out = QuantLinear(qw, None, CPU, torch.float32, INT8)(x)
    assert torch.equal(out.double(), x.double() @ w.t())


# int8 codes that span 6 bits: GGUF Q6_K (q - 32, g 16), Q5_K (q in [0, 31], zeros), Q5_0
# (q - 16), and [0, 63] (the widest span, zeros): lo, hi (exclusive), group, zeros, offset
NARROW = [(-32, 32, 16, False, 32), (0, 32, 32, True, 32), (-16, 16, 32, False, 32),
          (0, 64, 16, True, 0)]  # fmt: skip


def _narrow_weights(lo: int, hi: int, group: int, zeros: bool, n: int = 80) -> QuantizedWeight:
    g = torch.Generator().manual_seed(n + lo + group)
    codes = torch.randint(lo, hi, (n, 512), generator=g).to(torch.int8)
    codes[:, :4], codes[:, 4:8] = lo, hi - 1  # both ends of the span in every channel
    scales = torch.rand(n, 512 // group, generator=g) * 0.02 + 0.001
    z = torch.randn(n, 512 // group, generator=g) * 0.05 if zeros else None
    return QuantizedWeight(codes, scales, z, 8, group)


def _sign_trick(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The same records through the full-range int8 path (offset 128, vpsignb)."""
    out = x.new_empty(x.shape[0], layer.out_features)
    torch.ops.kvserve.quant_linear_a8(out, x, layer.codes, 8, layer.group_size, 128,
                                      layer.scale_format & ~A8_NARROW, layer.has_zeros)  # fmt: skip
    return out


@needs_avx2
@pytest.mark.parametrize(("lo", "hi", "group", "zeros", "offset"), NARROW)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_codes_equal_the_sign_trick_exactly(
    lo: int, hi: int, group: int, zeros: bool, offset: int, dtype: torch.dtype
) -> None:
    """Codes within 6 bits run as c + o, vpmaddubsw's unsigned operand, with o * sum(q) taken
    off each block's int32 sum: the same exact integers as the sign trick's, so the same
    outputs bit for bit, for 1-9 rows (2-row passes and a 1-row tail) and N = 80 and 208."""
    if dtype == torch.bfloat16 and _a8_kernel():
        pytest.skip("bf16 runs on the VNNI kernel here (it reads the same records as int8)")
    for n in (80, 208):
        qw = _narrow_weights(lo, hi, group, zeros, n)
        layer = QuantLinear(qw, None, CPU, dtype, INT8)
        assert (layer.path, layer.offset) == ("a8", offset)
        assert layer.scale_format & A8_NARROW
        for rows in (1, 2, 3, 9):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
            out = layer(x)
            assert torch.equal(out, _sign_trick(layer, x))
            exact = _exact(x, qw)
            bound = 1e-5 * float(exact.abs().max()) + (
                exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0.0
            )
            assert bool(((out.double() - exact).abs() <= bound).all())


@needs_avx2
def test_narrow_integer_inputs_give_exact_products() -> None:
    """Unit scales, x at +-127 in every block (d = 1): the narrow path's int16 pairs of quads
    at their largest (c + o = 63 times 127, four times) stay exact."""
    n, k, rows = 32, 128, 3
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(-32, 32, (n, k), generator=g).to(torch.int8)
    codes[:, :16] = 31  # c + 32 = 63: 4 * 63 * 127 = 32004 in one int16 sum
    qw = QuantizedWeight(codes, torch.ones(n, k // 16), None, 8, 16)
    x = torch.randint(-127, 128, (rows, k), generator=g).float()
    x[:, :16] = 127.0
    x[:, 16::32] = -127.0
    layer = QuantLinear(qw, None, CPU, torch.float32, INT8)
    assert (layer.scale_format & A8_NARROW, layer.offset) == (A8_NARROW, 32)
    assert torch.equal(layer(x).double(), x.double() @ codes.double().t())


@needs_avx2
@pytest.mark.parametrize(
    ("bits", "group", "zeros", "half"), [(8, 32, False, True), (4, 32, True, True)]
)
def test_a_row_does_not_depend_on_its_batch(bits: int, group: int, zeros: bool, half: bool) -> None:
    """Rows run four at a time, each in the same order: row i of a batch of 7 is bit-equal to
    row i alone (docs/ARCHITECTURE.md: batch-invariant quantized layers)."""
    qw = _weights(80, 256, bits, group, zeros, half)
    layer = QuantLinear(qw, None, CPU, torch.float32, INT8)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    batch = layer(x)
    for i in range(7):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_round_half_to_even_as_the_reference(dtype: torch.dtype) -> None:
    """The kernel's own 8-wide quantization of x (scale, rounding, the int8 it stores) reads
    back exactly as ``quantize_activations``: one-hot int8 codes with unit scales make output
    n the quantized x at column n + 2, times the block's scale. Columns 0 and 1 of each block
    hold +-127 (scale 1) except in the last block, whose largest value is 100 (scale 100 / 127,
    so x * 127 / 100 is rounded); the others are halves (2.5 -> 2, 3.5 -> 4, -0.5 -> 0)."""
    n, k, rows = 32, 128, 5
    codes = torch.zeros(n, k, dtype=torch.int8)
    codes[torch.arange(n), torch.arange(n) * 4 + 2] = 1  # channel j reads column 4j + 2
    qw = QuantizedWeight(codes, torch.ones(n, k // 32, dtype=torch.float16), None, 8, 32)
    halves = torch.arange(-64, 64, dtype=torch.float32) + 0.5  # [-63.5 .. 63.5]
    x = halves[torch.randperm(128, generator=torch.Generator().manual_seed(5))][:k]
    x = x.repeat(rows, 1)  # [rows, K]
    x[:, 0:96:32], x[:, 1:96:32] = 127.0, -127.0
    x[:, 96], x[:, 97] = 100.0, -100.0
    x[1:] *= torch.arange(1, rows).float().unsqueeze(1) / 4  # other scales per row
    x = x.to(dtype)
    q, d = quantize_activations(x)  # [rows, K] int8, [rows, K / 32]
    want = exact_activations(q, d)[:, torch.arange(n) * 4 + 2]  # [rows, N]
    out = QuantLinear(qw, None, CPU, dtype, INT8)(x).double()
    if dtype == torch.float32:
        assert torch.equal(out, want.float().double())
    else:  # bf16 outputs: the same values rounded once
        assert torch.equal(out, want.to(torch.bfloat16).double())


@needs_avx2
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_takes_int8_for_4bit_codes_without_vnni(
    bits: int, group: int, zeros: bool, half: bool, dtype: torch.dtype
) -> None:
    """auto: int8 activations where they are the faster kernel (a8_auto_supports): bf16 with
    the VNNI kernel; without it, 4-bit codes on the AVX2 path (full-range byte codes keep the
    float kernel, which wins from 64 rows there); and the layer runs the path it says."""
    qw = _weights(80, 512, bits, group, zeros, half)
    layer = QuantLinear(qw, None, CPU, dtype, QuantizedActivations.AUTO)
    want_a8 = dtype == torch.bfloat16 if _a8_kernel() else bits == 4
    assert layer.int8_activations is want_a8
    assert layer.path == ("a8" if want_a8 else "kernel")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(bits + group)).to(dtype)
    explicit = QuantLinear(qw, None, CPU, dtype, INT8 if want_a8 else QuantizedActivations.NONE)
    assert torch.equal(layer(x), explicit(x))


@needs_avx2
@pytest.mark.parametrize(("lo", "hi", "group", "zeros", "offset"), NARROW[:2])
def test_auto_takes_int8_for_narrow_byte_codes_without_vnni(
    lo: int, hi: int, group: int, zeros: bool, offset: int
) -> None:
    """Q6_K- and Q5_K-like byte codes: int8 activations under auto on float32 without VNNI
    (their narrow path beat the float32 kernel at 1 to 64 rows), float32 beside VNNI."""
    qw = _narrow_weights(lo, hi, group, zeros)
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.AUTO)
    assert layer.int8_activations is not _a8_kernel()


def test_report_says_which_layers_took_int8() -> None:
    """The load log's activations: every layer, none, or how many (auto on AVX2 leaves
    full-range byte codes, such as a Q8_0 LM head, in float32)."""
    from kvserve.quantization.apply import QuantReport

    mixed = QuantReport("gguf", layers=155, int8_layers=112)
    assert "activations: int8 in 112 of 155 layers, model dtype in the rest;" in mixed.summary()
    every = QuantReport("gguf", layers=88, int8_layers=88)
    assert "activations: int8;" in every.summary()
    assert "activations: model dtype;" in QuantReport("int8", layers=88).summary()
