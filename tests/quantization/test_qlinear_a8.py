"""The int8-activation kernel (``csrc/quant_linear_a8.cpp``) against its reference
(``reference_linear_a8``), its layout, and how ``QuantLinear`` picks it."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import QuantizedActivations
from kvserve.ops import cpu_kernels
from kvserve.quantization.qlinear import (
    QuantLinear,
    exact_activations,
    pack_a8,
    pack_codes_a8,
    quantize_activations,
    reference_linear_a8,
)
from kvserve.quantization.qweight import QuantizedWeight
from tests.quantization.test_qlinear import _weights

CPU = torch.device("cpu")
A8 = QuantizedActivations


def _a8_kernel() -> bool:
    return cpu_kernels.available() and bool(torch.ops.kvserve.quant_linear_a8_supported())


def _a8_avx2() -> bool:
    return cpu_kernels.available() and torch.ops.kvserve.quant_linear_a8_isa() == "avx2"


needs_a8 = pytest.mark.skipif(not _a8_kernel(), reason="needs AVX512-VNNI and AVX512-BF16")

CASES = [  # bits, group, zeros, float16 scales
    (8, 64, False, True),  # per channel (K = 64), like --quantization int8
    (8, 32, False, True),  # Q8_0
    (8, 16, False, False),  # Q6_K: two scales per block of 32
    (8, 128, True, False),
    (4, 32, False, True),  # int4 symmetric / Q4_0
    (4, 32, True, True),  # int4 / Q4_1
    (4, 32, True, False),  # Q4_K
    (4, 16, True, False),
    (4, 64, False, True),
]


@needs_a8
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 70, 130])
def test_kernel_equals_reference(bits: int, group: int, zeros: bool, half: bool, rows: int) -> None:
    # N = 96 and 80: full 64-channel tiles, 2- and 1-vector tails; rows > 64: two row chunks
    for n in (96, 80):
        qw = _weights(n, 512 if group != 64 else 64, bits, group, zeros, half)
        x = torch.randn(rows, qw.shape[1], generator=torch.Generator().manual_seed(rows))
        layer = QuantLinear(qw, None, CPU, torch.bfloat16, A8.INT8)
        assert layer.path == "a8"
        out = layer(x.bfloat16()).double()
        # the reference in float64, before its rounding to bf16
        q, d = quantize_activations(x.bfloat16())
        exact = exact_activations(q, d) @ qw.exact().t()
        # bf16 output rounding (2^-9 relative) plus float32 sums: at most 2^-8 of each value
        bound = exact.abs() * 2.0**-8 + 1e-5 * float(exact.abs().max())
        assert bool(((out - exact).abs() <= bound).all())
        ref = reference_linear_a8(x.bfloat16(), qw)
        assert torch.equal(ref.double(), exact.bfloat16().double())


@needs_a8
@pytest.mark.parametrize(("bits", "zeros"), [(8, False), (4, False), (4, True)])
def test_integer_inputs_give_exact_products(bits: int, zeros: bool) -> None:
    """Unit scales and blocks whose largest |x| is 127 (or 63.5): the activation codes are
    round(x) (or round(2x)), half to even, and every sum is an exact integer, so the output
    is exactly the integer product rounded once to bf16. One activation rounded differently
    from the reference moves an output by at least one whole code."""
    n, k, rows = 32, 128, 3
    g = torch.Generator().manual_seed(bits)
    lo, hi = (-128, 128) if bits == 8 else ((0, 16) if zeros else (-8, 8))
    codes = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    scales = torch.ones(n, k // 32, dtype=torch.float16)
    z = torch.randint(-3, 4, (n, k // 32), generator=g).to(torch.float16) if zeros else None
    qw = QuantizedWeight(codes, scales, z, bits, 32)
    halves = torch.randint(-253, 254, (rows, k), generator=g).double() / 2  # steps of 0.5
    halves[:, ::32] = 127.0  # every block's max: scale 1, x -> round(x)
    halves[1, ::32] = -63.5  # row 1: max 63.5, x -> round(2x)
    halves[1] = halves[1].clamp(-63.5, 63.5)
    x = halves.bfloat16()
    assert torch.equal(x.double(), halves)  # all representable in bf16
    q, d = quantize_activations(x)
    want_q = torch.round(halves * torch.tensor([1.0, 2.0, 1.0]).unsqueeze(1))  # half to even
    assert torch.equal(q.double(), want_q)
    assert torch.equal(d[1], torch.full((k // 32,), 0.5))
    w = codes.double() + (0 if z is None else z.double().repeat_interleave(32, 1))
    want = (q.double() * d.double().repeat_interleave(32, 1)) @ w.t()  # exact integers / 2
    out = QuantLinear(qw, None, CPU, torch.bfloat16, A8.INT8)(x)
    assert torch.equal(out, want.bfloat16())


@needs_a8
@pytest.mark.parametrize(("bits", "group"), [(8, 32), (8, 16), (4, 32), (4, 64)])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_offset_codes_cancel_exactly(bits: int, group: int, rows: int) -> None:
    """Without zeros the codes' offset o (u = c + o) leaves the int32 sums as their start,
    -o * sum(q): codes that cancel against the activations give exactly 0 whatever the
    scales. The float zero term the kernel had instead, (-o * s) * sum(d * q), rounded a
    difference of two large sums (rows: one row, a micro-tile, int4's 8-bit tile copies)."""
    n, k = 32, 256
    g = torch.Generator().manual_seed(bits + group + rows)
    lim = 127 if bits == 8 else 7
    half = torch.randint(-lim, lim + 1, (n, k // 2), generator=g)
    codes = torch.stack([half, -half], dim=2).reshape(n, k).to(torch.int8)  # c[2i+1] = -c[2i]
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).to(torch.float16)
    qw = QuantizedWeight(codes, scales, None, bits, group)
    x = torch.randn(rows, k // 2, generator=g).repeat_interleave(2, dim=1)  # x[2i] = x[2i+1]
    layer = QuantLinear(qw, None, CPU, torch.bfloat16, A8.INT8)
    assert layer.path == "a8" and layer.offset != 0
    out = layer(x.bfloat16())
    assert torch.equal(out, torch.zeros_like(out))
    # the same weights against other activations are not zero (the test can fail)
    assert bool(layer(torch.randn(rows, k, generator=g).bfloat16()).abs().gt(0).any())


def test_quantize_activations_rounds_half_to_even_per_block() -> None:
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
    x[0, 32:34] = torch.tensor([-254.0, 3.0])  # block 2: scale 2, 3 / 2 -> 2 (even)
    q, d = quantize_activations(x.bfloat16())
    assert q[0, :4].tolist() == [127, 0, 2, -2]
    assert q[0, 32:34].tolist() == [-127, 2]
    assert d[0].tolist() == [1.0, 2.0]
    assert d[1].tolist() == [0.0, 0.0] and not q[1].any()  # an all-zero block: codes 0


def test_pack_codes_a8_layout() -> None:
    n, k = 16, 64
    codes = (torch.arange(n * k) % 16 - 8).to(torch.int8).reshape(n, k)  # [-8, 7]
    int8, off8 = pack_codes_a8(codes, 8)
    assert off8 == 128 and int8.dtype == torch.uint8 and int8.shape == (1, 2, 2, 4, 16, 4)
    # block 1, quad 5 (k = 32 + 20 + i), channel 3: code[3, 52 + i] + 128
    assert int8[0, 1, 1, 1, 3].tolist() == [int(codes[3, 52 + i]) + 128 for i in range(4)]
    int4, off4 = pack_codes_a8(codes, 4)
    assert off4 == 8 and int4.shape == (1, 2, 4, 16, 4)
    # block 0, vector 2, channel 7, byte i: low nibble k = 8 + i, high nibble k = 24 + i
    for i in range(4):
        byte = int(int4[0, 0, 2, 7, i])
        assert byte & 15 == int(codes[7, 8 + i]) + 8 and byte >> 4 == int(codes[7, 24 + i]) + 8


def test_pack_a8_records() -> None:
    """One record per vector and group: scales, zeros, then the group's codes, bytes exact."""
    n, k = 32, 128
    codes = (torch.arange(n * k) % 16).to(torch.int8).reshape(n, k)  # [0, 15]
    scales = (torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 1).half()
    zeros = -scales
    packed, off = pack_a8(QuantizedWeight(codes, scales, zeros, 4, 64))  # 2 records a vector
    assert off == 0 and packed.shape == (2, 2, 32 + 32 + 2 * 256)
    blocks, _ = pack_codes_a8(codes, 4)  # [2, 4, 4, 16, 4]: vector, block of 32, ...
    for v, r in ((0, 0), (1, 1), (1, 0)):
        rec = packed[v, r]
        assert torch.equal(rec[:32].view(torch.float16), scales[16 * v : 16 * v + 16, r])
        assert torch.equal(rec[32:64].view(torch.float16), zeros[16 * v : 16 * v + 16, r])
        assert torch.equal(rec[64:], blocks[v, 2 * r : 2 * r + 2].reshape(-1))
    # g = 16: a record per block of 32 holds both groups' scales; float32 where they are
    # (and float16 cannot hold them: 1 + 2^-12 needs float32's mantissa)
    halves = QuantizedWeight(codes, scales.float().repeat(1, 4) * (1 + 2.0**-12), None, 4, 16)
    packed, _ = pack_a8(halves)
    assert packed.shape == (2, 4, 32 * 4 + 256)
    rec = packed[1, 3]
    assert torch.equal(rec[:128].view(torch.float32), halves.scales[16:32, 6:8].t().reshape(-1))
    assert torch.equal(rec[128:], blocks[1, 3].reshape(-1))


def test_activation_modes_resolve_per_layer() -> None:
    qw = _weights(32, 64, 4, 32, True, True)
    f32 = QuantLinear(qw, None, CPU, torch.float32, A8.AUTO)
    # auto: float32 keeps exact products beside the VNNI kernel; int4 takes the AVX2 path
    # without it (qlinear.a8_auto_supports)
    assert f32.int8_activations is (not _a8_kernel() and _a8_avx2())
    forced = QuantLinear(qw, None, CPU, torch.float32, A8.INT8)  # opt-in: the AVX2 kernel
    assert forced.int8_activations and forced.path == ("a8" if _a8_avx2() else "reference")
    x = torch.randn(3, 64)
    if forced.path == "reference":
        assert torch.equal(forced(x), reference_linear_a8(x, qw))
    none = QuantLinear(qw, None, CPU, torch.bfloat16, A8.NONE)
    assert not none.int8_activations and none.path != "a8"
    auto = QuantLinear(qw, None, CPU, torch.bfloat16, A8.AUTO)
    assert auto.path == ("a8" if _a8_kernel() or _a8_avx2() else none.path)
    odd = _weights(32, 48, 8, 48, False, True)  # K = 48: not blocks of 32
    assert not QuantLinear(odd, None, CPU, torch.bfloat16, A8.AUTO).int8_activations
    with pytest.raises(ValueError, match="input size 48 is not a multiple of 32"):
        QuantLinear(odd, None, CPU, torch.bfloat16, A8.INT8)
