"""The C++ quantized linear kernel against its pure-PyTorch reference (dequantize + F.linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.config import Quantization
from kvserve.ops import cpu_kernels
from kvserve.quantization.apply import QuantOptions, quantize_model
from kvserve.quantization.qlinear import (
    DIRECT_ROWS,
    QuantLinear,
    bf16_native,
    pack_codes,
    reference_linear,
)
from kvserve.quantization.qweight import QuantizedWeight, quantize_rtn

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ kernels")


def _weights(n: int, k: int, bits: int, group: int, zeros: bool, half: bool) -> QuantizedWeight:
    g = torch.Generator().manual_seed(n * 1000 + k + bits + group)
    lo, hi = (-128, 128) if bits == 8 else ((0, 16) if zeros else (-8, 8))
    codes = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8)
    dtype = torch.float16 if half else torch.float32
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    z = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype) if zeros else None
    return QuantizedWeight(codes, scales, z, bits, group)


CASES = [  # bits, group, zeros, float16 scales
    (8, 64, False, True),  # per channel (K = 64) like --quantization int8
    (8, 32, False, True),  # Q8_0
    (8, 16, False, False),  # Q6_K
    (4, 32, False, True),  # int4 / Q4_0
    (4, 32, True, True),  # Q4_1
    (4, 32, True, False),  # Q4_K
    (4, 16, False, False),
]


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
def test_float32_kernel_equals_reference(
    bits: int, group: int, zeros: bool, half: bool, rows: int
) -> None:
    # N = 80: one full 64-channel tile and a 16-channel tail; K = 640: several K chunks
    qw = _weights(80, 640 if group != 64 else 64, bits, group, zeros, half)
    x = torch.randn(rows, qw.shape[1], generator=torch.Generator().manual_seed(rows))
    layer = QuantLinear(qw, None, CPU, torch.float32)
    assert layer.use_kernel
    ref = reference_linear(x.double(), qw).float()  # exact products, float64 sums
    out = layer(x)
    # float32 sums of 640 products in another order: a few ulps of the largest partial sum
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


F32_CASES = [  # bits, group, zeros, float16 scales, N (not a multiple of 64), K
    (8, 32, False, True, 80, 256),  # Q8_0
    (8, 128, False, False, 208, 384),
    (8, 64, True, True, 48, 64),  # one group: per channel
    (4, 32, False, True, 112, 512),  # Q4_0
    (4, 32, True, False, 80, 320),  # Q4_K-like
    (4, 64, True, True, 16, 192),
    (4, 128, False, False, 208, 768),
]


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "zeros", "half", "n", "k"), F32_CASES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tiles"])
def test_each_float32_path_equals_reference(
    bits: int, group: int, zeros: bool, half: bool, n: int, k: int, rows: int, direct: bool
) -> None:
    """Both float32 paths (AVX2 where built: csrc/quant_linear_avx2.h) at every row count."""
    qw = _weights(n, k, bits, group, zeros, half)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    layer = QuantLinear(qw, None, CPU, torch.float32)
    out = x.new_empty(rows, n)
    torch.ops.kvserve.quant_linear(
        out, x, layer.codes, layer.scales_t, layer.zeros_t, bits, group, layer.offset,
        rows if direct else 0,
    )  # fmt: skip
    ref = reference_linear(x.double(), qw).float()  # exact products, float64 sums
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernels
def test_the_float32_paths_are_avx2_where_the_cpu_has_it() -> None:
    has = not cpu_kernels.missing_flags(cpu_kernels.CpuIsa.AVX2, cpu_kernels.cpu_flags())
    want = "avx2" if has else "generic"
    assert str(torch.ops.kvserve.quant_linear_f32_isa()) == want


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "zeros", "half"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64, 130])  # direct up to DIRECT_ROWS
def test_bf16_kernel_equals_reference(
    bits: int, group: int, zeros: bool, half: bool, rows: int
) -> None:
    qw = _weights(96, 512 if group != 64 else 64, bits, group, zeros, half)
    x = torch.randn(rows, qw.shape[1], generator=torch.Generator().manual_seed(rows))
    x = x.bfloat16()
    layer = QuantLinear(qw, None, CPU, torch.bfloat16)
    assert layer.use_kernel
    out = layer(x).float()
    # The reference rounds each weight to bf16 before the product, as the batched kernel
    # does; the direct path (<= DIRECT_ROWS rows) and the widened float32 path of CPUs without
    # AVX512-BF16 keep float32 weights. All sum in float32: the difference is the rounding of
    # the weights (2^-9 relative each) and of the output.
    exact = x.double() @ qw.dequantize(torch.float64).t()
    ref = reference_linear(x, qw).float()
    scale = float(exact.abs().max())
    assert float((out - exact).abs().max()) < 6e-3 * scale
    assert float((ref - exact).abs().max()) < 6e-3 * scale
    if rows > DIRECT_ROWS and bf16_native():
        # batched path: the reference's bf16 weights, float32 sums, bf16 output
        assert float((out - ref).abs().max()) <= 2**-7 * scale


@needs_kernels
def test_bias_and_leading_dims() -> None:
    qw = quantize_rtn(torch.randn(32, 64), 4, 32)
    bias = torch.randn(32)
    layer = QuantLinear(qw, bias, CPU, torch.float32)
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, reference_linear(x, qw, bias), rtol=1e-5, atol=1e-5)


def test_no_kernel_falls_back_to_the_reference() -> None:
    qw = quantize_rtn(torch.randn(24, 64), 8, None)  # N = 24 is not a multiple of 16
    layer = QuantLinear(qw, None, CPU, torch.float32)
    assert not layer.use_kernel
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), reference_linear(x, qw))


def test_pack_codes_layouts() -> None:
    codes = torch.arange(16 * 4, dtype=torch.int8).reshape(16, 4) % 16 - 8  # [-8, 7]
    int8, off8 = pack_codes(codes, 8)
    assert off8 == 0 and int8.shape == (1, 2, 2, 16)
    assert int8[0, 1, 0].tolist() == codes[:, 2].tolist()  # pair 1, first of the pair: k = 2
    assert int8[0, 1, 1].tolist() == codes[:, 3].tolist()
    int4, off4 = pack_codes(codes, 4)
    assert off4 == 8 and int4.shape == (1, 2, 16) and int4.dtype == torch.uint8
    byte = int(int4[0, 1, 5])  # channel 5, pair 1
    assert (byte & 15) - 8 == int(codes[5, 2]) and (byte >> 4) - 8 == int(codes[5, 3])
    assert pack_codes(codes + 8, 4)[1] == 0  # [0, 15]: stored as is
    with pytest.raises(ValueError, match=r"int4 codes span \[-8, 9\]"):
        pack_codes(torch.cat([codes, torch.full((16, 2), 9, dtype=torch.int8)], 1), 4)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 32, bias=True)
        self.block = nn.Sequential(nn.Linear(32, 48))
        self.lm_head = nn.Linear(32, 10, bias=False)


def test_quantize_model_replaces_all_but_the_lm_head() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    report = quantize_model(model, QuantOptions(Quantization.INT4), CPU, torch.float32)
    assert isinstance(model.proj, QuantLinear) and model.proj.group_size == 32
    assert isinstance(model.block[0], QuantLinear)
    assert isinstance(model.lm_head, nn.Linear)
    assert report.layers == 2 and set(report.errors) == {"proj", "block.0"}
    # 64*32 + 32*48 int4 weights + a float16 scale and zero per 32
    assert report.weight_bytes == (64 * 32 + 32 * 48) // 2 + (64 * 32 + 32 * 48) // 32 * 4
    assert all(0 < e < 0.2 for e in report.errors.values())


def test_quantize_model_names_the_layer_a_group_does_not_fit() -> None:
    want = r"cannot quantize block\.0: .* group size 64 must be even"
    with pytest.raises(ValueError, match=want):
        quantize_model(_Tiny(), QuantOptions(Quantization.INT8, 64), CPU, torch.float32)


def test_cuda_is_refused_rather_than_dequantized_per_call() -> None:
    """No CUDA kernel yet: on CUDA each call would dequantize the whole weight (issue 29)."""
    qw = _weights(16, 64, 8, 64, False, False)
    with pytest.raises(ValueError, match="run on kvserve's CPU kernels only"):
        QuantLinear(qw, None, torch.device("cuda"), torch.float32)
    assert QuantLinear(qw, None, torch.device("cpu"), torch.float32).out_features == 16
