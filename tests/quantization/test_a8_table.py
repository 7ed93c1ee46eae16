"""Table codes (``quantization/a8_table.py``): 8-bit codes of at most 16 values (MXFP4, GGUF
IQ4_NL) stream as 4-bit indices into a 16-byte table on the AVX512-VNNI int8-activation
kernel, giving the outputs of the same codes stored as bytes (with the same offset) bit for
bit, in 4.5 bits a weight for MXFP4 (float16 scales, which hold its powers of two exactly);
and on the weight-only kernel (float32 activations on every CPU, bf16 ones with
``--quantization-activations none``), giving its byte codes' outputs bit for bit too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve.config import QuantizedActivations
from kvserve.quantization.a8_table import A8_TABLE, TABLE_BYTES, TABLE_OFFSET, A8Table, a8_table
from kvserve.quantization.gguf_weights import tensor_to_qweight
from kvserve.quantization.qlinear import (
    A8Scales,
    QuantLinear,
    a8_scale_dtype,
    pack_a8,
    pack_codes,
    reference_linear,
)
from kvserve.quantization.qweight import QuantizedWeight
from tests.quantization.test_a8_gguf_records import assert_near_exact, k_blocks
from tests.quantization.test_qlinear_a8 import needs_a8

CPU = torch.device("cpu")
K = 512


def mxfp4_weight(n: int, seed: int) -> QuantizedWeight:
    """Random MXFP4 blocks (exponent bytes 2^-9 .. 2^-4) as GGUF stores them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * K // 32, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(118, 124, len(blocks), dtype=np.uint8)
    return tensor_to_qweight("blk.0.ffn_down_exps.weight", T.MXFP4, blocks, n, K)


def weight(qtype: T, n: int, seed: int) -> QuantizedWeight:
    if qtype == T.MXFP4:
        return mxfp4_weight(n, seed)
    return tensor_to_qweight("blk.0.ffn_up.weight", qtype, k_blocks(qtype, n, K, seed), n, K)


def test_table_of_the_codes() -> None:
    """The values present, ascending; indices into them; the trailer's bytes u = c + o."""
    codes = torch.tensor([[-12, 0, 3, 12, -1, 6] * 16] * 16, dtype=torch.int8)  # [16, 96]
    qw = QuantizedWeight(codes, torch.ones(16, 3), None, bits=8, group_size=32)
    table = a8_table(qw)
    assert table is not None and table.values.tolist() == [-12, -1, 0, 3, 6, 12]
    assert table.offset == 12
    assert table.indices(codes)[0, :6].tolist() == [0, 2, 3, 5, 1, 4]
    trailer = table.trailer()
    assert trailer.shape == (TABLE_BYTES,)
    assert trailer[:16].tolist() == [0, 11, 12, 15, 18, 24] + [24] * 10
    signed = table.signed_trailer()  # quant_linear's: the values' own bytes
    assert signed.shape == (TABLE_BYTES,) and signed.dtype == torch.uint8
    assert signed[:16].view(torch.int8).tolist() == [-12, -1, 0, 3, 6, 12] + [12] * 10
    assert signed[16:].tolist() == [0] * (TABLE_BYTES - 16)
    assert A8Table(torch.tensor([0, 5], dtype=torch.int8)).offset == 0
    # 17 values, or codes already 4-bit: no table
    many = torch.arange(-8, 9, dtype=torch.int8).repeat(16, 2)[:, :32]
    assert a8_table(QuantizedWeight(many, torch.ones(16, 1), None, 8, 32)) is None
    four = torch.zeros(16, 32, dtype=torch.int8)
    assert a8_table(QuantizedWeight(four, torch.ones(16, 1), None, 4, 32)) is None
    assert a8_table(weight(T.Q8_0, 32, 0)) is None  # all 256 values in use


def test_mxfp4_scales_pack_as_float16() -> None:
    """MXFP4's float32 scales are powers of two float16 holds: packed as float16."""
    qw = mxfp4_weight(32, 0)
    assert qw.scales.dtype == torch.float32 and a8_scale_dtype(qw) == torch.float16
    odd = QuantizedWeight(qw.codes, qw.scales * (1 + 2.0**-12), None, 8, 32)
    assert a8_scale_dtype(odd) == torch.float32  # 1 + 2^-12 needs float32's mantissa


@needs_a8
@pytest.mark.parametrize("qtype", [T.MXFP4, T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 17, 70])
def test_table_codes_equal_byte_codes(qtype: T, rows: int) -> None:
    """The layer picks table codes on the VNNI kernel; its outputs equal the same codes'
    8-bit records with the table's offset bit for bit, in place (< 16 rows) and on the
    expanded copy (17, 70), for full tiles and 1- and 2-vector tails (N 96, 80). IQ4_XS
    (two levels of scales) takes per-group records for it: float32 scales, 5 bits a weight
    instead of its super records' 8.3."""
    fmt = A8Scales.FLOAT32 if qtype == T.IQ4_XS else A8Scales.FLOAT16
    for n in (96, 80):
        qw = weight(qtype, n, rows)
        assert (qw.supers is not None) == (qtype == T.IQ4_XS)
        layer = QuantLinear(qw, None, CPU, torch.bfloat16, QuantizedActivations.INT8)
        table = a8_table(qw)
        assert table is not None and layer.path == "a8"
        assert (layer.code_bits, layer.scale_format) == (4, A8_TABLE | fmt)
        # 4-bit indices and float16 (float32) scales: 4.5 (5) bits a weight, and the trailer
        width = 4 if fmt == A8Scales.FLOAT32 else 2
        assert layer.nbytes == n * K // 2 + n * K // 32 * width + TABLE_BYTES
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(n)).bfloat16()
        out = layer(x)
        ref = torch.empty_like(out)
        flat = QuantizedWeight(qw.codes, qw.scales, qw.zeros, qw.bits, qw.group_size)
        packed, off = pack_a8(flat, fmt, 8, off=table.offset)
        assert off == layer.offset
        torch.ops.kvserve.quant_linear_a8(ref, x, packed, 8, 32, off, int(fmt), False)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
        assert_near_exact(out, x, qw)


@needs_a8
def test_table_codes_only_on_the_vnni_kernel() -> None:
    """float32 activations (the AVX2 int8 path) keep byte codes; the op refuses table codes
    there, with other bit widths, and a buffer without its trailer."""
    qw = mxfp4_weight(32, 1)
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.INT8)
    assert not layer.scale_format & A8_TABLE
    table = a8_table(qw)
    assert table is not None
    packed, off = pack_a8(qw, A8Scales.FLOAT16, 4, table)
    out, x = torch.empty(1, 32, dtype=torch.bfloat16), torch.randn(1, K).bfloat16()
    fmt = A8_TABLE | A8Scales.FLOAT16
    torch.ops.kvserve.quant_linear_a8(out, x, packed, 4, 32, off, fmt, False)
    with pytest.raises(RuntimeError, match="table codes are 4-bit"):
        torch.ops.kvserve.quant_linear_a8(out, x, packed, 8, 32, off, fmt, False)
    with pytest.raises(RuntimeError, match="pack_a8's records"):
        torch.ops.kvserve.quant_linear_a8(out, x, packed[:-TABLE_BYTES], 4, 32, off, fmt, False)
    with pytest.raises(RuntimeError, match="AVX512-VNNI only"):
        torch.ops.kvserve.quant_linear_a8(out.float(), x.float(), packed, 4, 32, off, fmt, False)


@pytest.mark.parametrize("qtype", [T.MXFP4, T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_only_kernel_takes_table_codes(qtype: T, dtype: torch.dtype) -> None:
    """Activations in the model dtype (float32: the AVX2 paths, pshufb; bf16 with
    activations 'none': vdpbf16ps tiles and vpermd, or widened to float32 without AVX512-BF16):
    the layer packs 4-bit indices and the table, and gives the outputs of the same codes
    packed as bytes bit for bit, on the direct path (1-4 rows) and the tiles (5, 17, 70),
    for full tiles and 1- and 2-vector tails (N 96, 80)."""
    for n in (96, 80):
        qw = weight(qtype, n, n)
        layer = QuantLinear(qw, None, CPU, dtype, QuantizedActivations.NONE)
        assert layer.path == "kernel" and (layer.code_bits, layer.offset) == (4, TABLE_OFFSET)
        assert layer.codes.numel() == n * K // 2 + TABLE_BYTES  # 4 bits a weight + the table
        # IQ4_NL's scales as the file has them (float16), MXFP4's float32 powers of two as
        # float16 (exact: the same products): 4.5 bits a weight; IQ4_XS's d * (ls - 32) per
        # group float32: 5
        assert qw.scales.dtype == (torch.float16 if qtype == T.IQ4_NL else torch.float32)
        width = 4 if qtype == T.IQ4_XS else 2
        assert layer.scales_t.element_size() == width
        assert layer.nbytes == n * K // 2 + TABLE_BYTES + n * K // 32 * width
        packed, off = pack_codes(qw.codes, 8)
        assert packed.numel() == n * K and off == 0
        for rows in (1, 3, 4, 5, 17, 70):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
            out = layer(x)
            ref = torch.empty_like(out)
            torch.ops.kvserve.quant_linear(ref, x, packed, layer.scales_t, layer.zeros_t, 8, 32,
                                           0, layer.direct_rows)  # fmt: skip
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))  # bit for bit
            want = reference_linear(x.double(), qw)  # the dequantized weight, float64
            err = (out.double() - want).abs().max() / want.abs().max()
            assert err < (1e-5 if dtype == torch.float32 else 1e-2), (rows, float(err))


def test_weight_only_op_checks_table_codes() -> None:
    """quant_linear refuses table codes of another width and a buffer without its table."""
    qw = mxfp4_weight(32, 2)
    layer = QuantLinear(qw, None, CPU, torch.float32, QuantizedActivations.NONE)
    out, x = torch.empty(1, 32), torch.randn(1, K)
    args = (layer.scales_t, layer.zeros_t)
    with pytest.raises(RuntimeError, match="table codes are 4-bit indices"):
        torch.ops.kvserve.quant_linear(out, x, layer.codes, *args, 8, 32, TABLE_OFFSET, 4)
    with pytest.raises(RuntimeError, match="do not hold N x K weights and a table"):
        torch.ops.kvserve.quant_linear(out, x, layer.codes[:-TABLE_BYTES], *args, 4, 32,
                                       TABLE_OFFSET, 4)  # fmt: skip
