"""``QuantLinear``: a weight-only quantized linear layer behind ``nn.Linear``'s interface.

The weight is int8 or int4 codes with group scales (``QuantizedWeight``). Two ways to take
the activations (``QuantizedActivations``):

* int8 (``auto``'s choice for bf16 on CPUs with AVX512-VNNI and for 4-bit codes on AVX2 CPUs
  without it, ``a8_auto_supports``; opt-in elsewhere): each row of x is
  quantized in blocks of 32, then integer dot products (``csrc/quant_linear_a8.cpp``: vpdpbusd
  for bf16 on AVX512-VNNI, vpmaddubsw on AVX2 for float32 and bf16, ``quant_linear_a8_avx2.h``;
  weights packed by ``pack_a8``); the reference is ``reference_linear_a8``.
* the model dtype (bf16 or float32): ``csrc/quant_linear.cpp`` (codes packed by
  ``pack_codes``), exact products with the dequantized weight; the reference is
  ``reference_linear``.

Where no kernel runs, the layer calls its reference: slow, since it rebuilds the full weight
every call.
"""

from __future__ import annotations

import enum
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import QuantizedActivations
from kvserve.ops import cpu_kernels
from kvserve.quantization.a8_table import A8_TABLE, TABLE_OFFSET, A8Table, a8_table
from kvserve.quantization.qweight import INT4_RANGES, SUPER_BLOCK, QuantizedWeight

logger = logging.getLogger(__name__)

# bf16 batches of up to this many rows take the kernel's direct path (codes times float32
# activations, a scale per group) instead of dequantizing to bf16 tiles for vdpbf16ps.
# Measured (benchmarks/quant_kernels.py, TinyLlama-1.1B's four projections, AMD EPYC Zen 5,
# 2 threads, us): 4 rows int8 direct 1030 / tiles 1357, 8 rows 2049 / 1751. The float32
# paths (csrc/quant_linear_avx2.h, also bf16 widened on AVX2-only CPUs) cross at the same
# place: AMD EPYC Zen 3, 1 thread, N=5632 K=2048, CPU time per call in us (a busy machine):
# int8 g32 4 rows direct 2893 / tiles 3729, 8 rows 5621 / 5415; int4 g32 2801 / 4058 and
# 6325 / 5137.
DIRECT_ROWS = 4


def reference_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [.., K] @ dequant(W)^T + bias`` with the weight dequantized to ``x``'s dtype."""
    return F.linear(x, qw.dequantize(x.dtype), bias)


def int4_offset(codes: torch.Tensor) -> int:
    """8 for int4 codes in [-8, 7], 0 for codes in [0, 15] (the kernel stores code + offset)."""
    lo, hi = int(codes.min()), int(codes.max())
    for first, last in INT4_RANGES:
        if first <= lo and hi <= last:
            return -first
    raise ValueError(f"int4 codes span [{lo}, {hi}], not one of {INT4_RANGES}")


def pack_codes(codes: torch.Tensor, bits: int, off: int | None = None) -> tuple[torch.Tensor, int]:
    """Codes ``[N, K]`` in the kernel's tile layout, and the int4 offset (0 for int8;
    ``int4_offset`` unless ``off`` is given).

    int8: ``[N/16, K/2, 2, 16]`` (16 channels of k, then of k + 1); int4: ``[N/16, K/2, 16]``
    bytes holding ``(c[k] + off) | (c[k + 1] + off) << 4``. See ``csrc/quant_linear.cpp``.
    """
    n, k = codes.shape
    blocks = codes.reshape(n // 16, 16, k // 2, 2)  # [N/16, 16, K/2, 2]
    if bits == 8:
        return blocks.permute(0, 2, 3, 1).contiguous(), 0
    off = int4_offset(codes) if off is None else off
    u = (blocks.to(torch.int16) + off).to(torch.uint8)  # [N/16, 16, K/2, 2] in [0, 15]
    packed = u[..., 0] | (u[..., 1] << 4)  # [N/16, 16, K/2]
    return packed.permute(0, 2, 1).contiguous(), off


def pack_kernel_codes(qw: QuantizedWeight) -> tuple[torch.Tensor, int, int]:
    """``qw``'s codes for ``quant_linear``: (codes, offset, bits). 8-bit codes of at most 16
    values (MXFP4, IQ4_NL) as table codes: the indices' int4 layout, the values in a trailer,
    offset ``TABLE_OFFSET`` (``a8_table``'s docstring); else ``pack_codes``."""
    table = a8_table(qw)
    if table is None:
        return (*pack_codes(qw.codes, qw.bits), qw.bits)
    packed, _ = pack_codes(table.indices(qw.codes), 4, off=0)  # [N/16, K/2, 16] nibbles
    return torch.cat([packed.reshape(-1), table.signed_trailer()]), TABLE_OFFSET, 4


def plane_offset(codes: torch.Tensor, bits: int) -> int | None:
    """The offset ``o`` putting ``codes`` in [0, 2^bits - 1] (2^(bits-1) for symmetric codes,
    0 for codes from 0), or None if they span more."""
    lo, hi = int(codes.min()), int(codes.max())
    for first in (-(1 << (bits - 1)), 0):
        if first <= lo and hi <= first + (1 << bits) - 1:
            return -first
    return None


def a8_code_bits(qw: QuantizedWeight, vnni: bool) -> int:
    """The bits the int8-activation kernel streams per code: 5 or 6 for the byte codes of GGUF
    Q5_0/Q5_1/Q5_K/Q6_K (int4 nibbles plus bit planes; the VNNI kernel only), else
    ``qw.bits``."""
    if vnni and qw.bits == 8:
        for bits in (5, 6):
            if plane_offset(qw.codes, bits) is not None:
                return bits
    return qw.bits


# Rows pack_codes_a8 packs at a time: its temporaries (a few bytes per weight) then stay at
# about PACK_ROWS * K bytes each, not the whole matrix's (Qwen3-0.6B's tied LM head: 155 M
# weights, so 155 MB per temporary at once).
PACK_ROWS = 4096


def pack_codes_a8(
    codes: torch.Tensor, bits: int, off: int | None = None
) -> tuple[torch.Tensor, int]:
    """Codes ``[N, K]`` in the int8-activation kernel's layout, and the offset ``o`` added to
    them (128 for int8, 8 or 0 for int4, ``plane_offset`` for 5 and 6 bits): vpdpbusd
    multiplies unsigned bytes by signed ones.

    int8: ``[N/16, K/32, 8, 16, 4]`` bytes ``c + o``; quad t of a block of 32 holds k = 4t..4t+3
    of 16 channels. int4: ``[N/16, K/32, 4, 16, 4]``, quad t in the low nibbles and quad t + 4
    in the high ones. 5 and 6 bits: int4's nibbles, then per higher bit a plane of 8 quads'
    64-bit masks (bit 4j + i: channel j, k = 4t + i), ``[N/16, K/32, 256 + 64 * planes]``.
    See ``csrc/quant_linear_a8.cpp``.
    """
    n = codes.shape[0]
    if off is None:  # else the caller's (a table's indices: 0, whatever their span)
        off = _a8_offset(codes, bits)
    first = _pack_rows_a8(codes[:PACK_ROWS], bits, off)
    if n <= PACK_ROWS:
        return first, off
    out = first.new_empty(n // 16, *first.shape[1:])  # filled a block of rows at a time
    out[: PACK_ROWS // 16] = first
    del first
    for r in range(PACK_ROWS, n, PACK_ROWS):
        out[r // 16 : (r + PACK_ROWS) // 16] = _pack_rows_a8(codes[r : r + PACK_ROWS], bits, off)
    return out, off


def _a8_offset(codes: torch.Tensor, bits: int) -> int:
    """``pack_codes_a8``'s offset for ``bits``-bit codes (module docstring there)."""
    if bits == 8:
        return 128
    if bits == 4:
        return int4_offset(codes)
    plane = plane_offset(codes, bits)
    if plane is None:
        raise ValueError(f"codes span [{int(codes.min())}, {int(codes.max())}], more than "
                         f"{bits} bits")  # fmt: skip
    return plane


def _pack_rows_a8(codes: torch.Tensor, bits: int, off: int) -> torch.Tensor:
    """``pack_codes_a8`` of some rows (a multiple of 16) with the offset ``off``."""
    n, k = codes.shape
    # c + o in uint8, wrapping: the bytes of c read unsigned are c + 256 for c < 0, and every
    # c + o lies in [0, 255]. No int16 copy: it was the largest temporary of an LM head's pack.
    u = codes.view(torch.uint8) + off  # [N, K]
    blocks = u.reshape(n // 16, 16, k // 32, 2, 4, 4)  # [N/16, ch, K/32, half, t, i]
    quads = blocks.permute(0, 2, 3, 4, 1, 5)  # [N/16, K/32, half, t, ch, i]
    if bits == 8:
        return quads.contiguous()
    nibbles = quads & 15 if bits > 4 else quads
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).contiguous()  # [N/16, K/32, 4, 16, 4]
    if bits == 4:
        return packed
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)  # bit b of a mask byte
    parts = [packed.reshape(n // 16, k // 32, 256)]
    for plane in range(bits - 4):
        bit = (quads >> (4 + plane)) & 1  # [N/16, K/32, half, t, ch, i]: quad 4 half + t
        masks = (bit.reshape(n // 16, k // 32, 8, 8, 8) * weights).sum(-1, dtype=torch.uint8)
        parts.append(masks.reshape(n // 16, k // 32, 64))  # 8 quads' 8-byte masks
    return torch.cat(parts, dim=2)


def pack_scales_a8(scales: torch.Tensor) -> torch.Tensor:
    """Scales (or zeros) ``[N, K/g]`` as ``[N/16, K/g, 16]``: each 16-channel vector's groups
    in a row."""
    n, groups = scales.shape
    return scales.reshape(n // 16, 16, groups).transpose(1, 2).contiguous()


class A8Scales(enum.IntEnum):
    """How ``pack_a8``'s records hold the scales (the op's ``scale_format``)."""

    FLOAT32 = 0
    FLOAT16 = 1  # every scale and zero is a float16 (GGUF's legacy types, kvserve's RTN)
    SUPERS = 2  # GGUF K-quants' two levels (qweight.SuperScales): both kernels (VNNI, AVX2)


# The op's scale_format bit for int8 codes that span 6 bits (GGUF Q5_0/Q5_1/Q5_K/Q6_K): its
# offset is then the o of ``plane_offset(codes, 6)`` and the AVX2 path multiplies c + o as
# vpmaddubsw's unsigned operand (no sign trick; csrc/quant_linear_a8_avx2.h).
A8_NARROW = 8


def a8_narrow_offset(qw: QuantizedWeight) -> int | None:
    """``A8_NARROW``'s offset for ``qw``'s int8 codes, or None where they span more than 6 bits
    or are not int8 (a min and a max: 0.3 ms for 11.5M codes)."""
    return plane_offset(qw.codes, 6) if qw.bits == 8 else None


def a8_scale_dtype(qw: QuantizedWeight) -> torch.dtype:
    """float16 when scales and zeros are all float16 (GGUF, kvserve's RTN) or float32 values
    float16 holds exactly (MXFP4's powers of two: the same products, half the bytes), else
    float32."""
    floats = [qw.scales] if qw.zeros is None else [qw.scales, qw.zeros]
    if all(f.dtype == torch.float16 for f in floats):
        return torch.float16
    if all(f.dtype == torch.float32 and torch.equal(f.half().float(), f) for f in floats):
        return torch.float16
    return torch.float32


def a8_scale_format(qw: QuantizedWeight, supers: bool = True) -> A8Scales:
    """Super-block records where the weight has them (both int8-activation kernels read them;
    ``supers`` False: not wanted, as with table codes), else the scales' own precision. On
    AVX2 a Q4_K weight then streams 4.6 bits a weight instead of 6 (float32 scale and zero per
    32), Q6_K's 8-bit codes 8.6 instead of 10."""
    if supers and qw.supers is not None and qw.group_size in (16, 32):
        return A8Scales.SUPERS
    return A8Scales.FLOAT16 if a8_scale_dtype(qw) == torch.float16 else A8Scales.FLOAT32


def _pack_supers(qw: QuantizedWeight, codes: torch.Tensor) -> torch.Tensor:
    """``pack_a8``'s super-block records (see ``csrc/quant_linear_a8.cpp``): per vector and
    256 values of K, d [16] float16, dmin [16], sc [G][16] int8, m [G][16], then 8 blocks'
    codes (``codes``: ``pack_codes_a8``'s ``[N/16, K/32, ...]``)."""
    sup = qw.supers
    assert sup is not None
    n, k = qw.shape
    blocks = k // SUPER_BLOCK

    def per_vector(t: torch.Tensor) -> torch.Tensor:  # [N, K/256 * G] -> [N/16, K/256, G*16]
        groups = t.shape[1] // blocks
        v = t.reshape(n // 16, 16, blocks, groups).permute(0, 2, 3, 1)  # [N/16, K/256, G, 16]
        return v.contiguous().view(torch.uint8).reshape(n // 16, blocks, -1)

    heads = [sup.d] if sup.dmin is None else [sup.d, sup.dmin]
    ints = [sup.sc] if sup.m is None else [sup.sc, sup.m]
    parts = [per_vector(t) for t in (*heads, *ints)]
    parts.append(codes.reshape(n // 16, blocks, -1))
    return torch.cat(parts, dim=2).contiguous()


def pack_a8(
    qw: QuantizedWeight,
    scales: A8Scales | None = None,
    bits: int | None = None,
    table: A8Table | None = None,
    off: int | None = None,
) -> tuple[torch.Tensor, int]:
    """The int8-activation kernel's one buffer for ``qw``, and the offset ``o`` of its codes.

    Per 16-channel vector, one record per group (per block of 32 when g = 16, whose two
    groups share it): the group's 16 scales (two groups' for g = 16), its zeros if any, then
    its codes (``pack_codes_a8``'s blocks): ``[N/16, records, header + codes]`` bytes. Each
    vector is then one sequential stream, as a GGUF block keeps its scale beside its codes;
    with scales and zeros in streams of their own a one-row int4 pass read 11% slower
    (see ``csrc/quant_linear_a8.cpp``). Scales and zeros are stored as ``scales`` says
    (default: ``a8_scale_dtype``; ``A8Scales.SUPERS``: ``_pack_supers``' records), the codes
    in ``bits`` (default ``qw.bits``; 5 or 6: ``pack_codes_a8``'s bit planes); with a
    ``table`` (``a8_table``), 4-bit indices into it and the table in a trailer of
    ``TABLE_BYTES`` after the records (the op's ``scale_format`` then carries ``A8_TABLE``).
    ``off``: the codes' offset instead of ``pack_codes_a8``'s choice (tests).
    """
    n, k = qw.shape
    if table is not None:
        codes, off = pack_codes_a8(table.indices(qw.codes), 4, 0)  # [N/16, K/32, 4, 16, 4]
    else:
        codes, off = pack_codes_a8(qw.codes, bits or qw.bits, off)  # [N/16, K/32, ...]
    if scales is A8Scales.SUPERS:
        return _pack_supers(qw, codes), off
    g = qw.group_size
    records = k // 32 if g == 16 else k // g
    if scales is None:
        dtype = a8_scale_dtype(qw)
    else:
        dtype = torch.float16 if scales is A8Scales.FLOAT16 else torch.float32
    floats = [qw.scales] if qw.zeros is None else [qw.scales, qw.zeros]
    parts = [pack_scales_a8(f.to(dtype)).view(torch.uint8).reshape(n // 16, records, -1)
             for f in floats]  # fmt: skip
    parts.append(codes.reshape(n // 16, records, -1))
    packed = torch.cat(parts, dim=2).contiguous()  # [N/16, records, bytes]
    if table is None:
        return packed, off
    return torch.cat([packed.reshape(-1), table.trailer()]), table.offset


def _transposed(scales: torch.Tensor) -> torch.Tensor:
    """Scales (or zeros) ``[N, K/g]`` as ``[K/g, N]``, ``csrc/quant_linear.cpp``'s layout."""
    return scales.t().contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as int8 blocks of 32: ``(q [M, K] int8, d [M, K/32] float32)``, x ~= d * q.

    d = max|x| / 127 and q = round(x * (127 / max|x|)), half to even, in float32: the same
    operations as the kernel's, so the same q and d.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)  # [M, K/32, 32]
    amax = xb.abs().amax(dim=-1)  # [M, K/32]
    # torch.div, not 127.0 / amax: Tensor.__rtruediv__ multiplies by the reciprocal, which
    # rounds differently from the kernel's division.
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), 0.0)
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8).reshape(m, k)
    return q, amax / 127.0


def exact_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``quantize_activations``' ``(q [M, K], d [M, K/32])`` as the float64 values d * q."""
    m, k = q.shape
    return (q.double().reshape(m, k // 32, 32) * d.double().unsqueeze(-1)).reshape(m, k)


def reference_linear_a8(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The int8-activation kernel's reference: ``x`` quantized as ``quantize_activations``
    does, times the dequantized weight, exactly (float64), rounded to ``x``'s dtype."""
    shape = x.shape
    if qw.in_perm is not None:  # the kernel's blocks of 32 are of the stored column order
        x = x.index_select(-1, qw.in_perm.to(x.device))
    q, d = quantize_activations(x.reshape(-1, shape[-1]))
    xq = exact_activations(q, d)  # [M, K]
    out = xq @ qw.exact().t()  # [M, N]
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*shape[:-1], qw.shape[0])


def kernel_supports(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C++ kernel can run this weight for activations of ``dtype`` on ``device``."""
    n, _ = qw.shape
    if device.type != "cpu" or n % 16:
        return False
    # bf16 runs everywhere: on bf16 dot products with AVX512-BF16, widened to the float32
    # path elsewhere (``bf16_native``)
    return dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()


def _a8_shape_ok(qw: QuantizedWeight) -> bool:
    """N a multiple of 16, K of 32, groups of 16 or a multiple of 32 (``pack_a8``'s records)."""
    n, k = qw.shape
    g = qw.group_size
    return n % 16 == 0 and k % 32 == 0 and (g == 16 or g % 32 == 0)


def a8_kernel_supports(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the int8-activation kernel runs this weight: bf16 on a CPU with AVX512-VNNI,
    float32 or bf16 on AVX2 (vpmaddubsw), for ``_a8_shape_ok`` shapes."""
    if device.type != "cpu" or not _a8_shape_ok(qw):
        return False
    vnni = dtype == torch.bfloat16 and _a8_kernel()
    return vnni or (dtype in (torch.float32, torch.bfloat16) and _a8_avx2())


def a8_auto_supports(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> bool:
    """Where ``auto`` takes int8 activations (x rounded to 8 bits per block of 32, as
    llama.cpp's Q8_0 activations: ~0.6% relative error against ``reference_linear``):
    * with AVX512-VNNI: bf16 layers (the VNNI kernel);
    * on AVX2 without it: 4-bit codes (float32 or bf16 x), the vpmaddubsw path. One N 5632 x
      K 2048 int4 layer, 2 threads, AMD EPYC Zen 3: 2.4x / 3.2x / 1.7-1.8x the float32
      path's speed at 1 / 8 / 64-512 rows; TinyLlama-1.1B's GGUF Q4_0 over HTTP 1.54x /
      1.70x / 1.36x llama.cpp's at concurrency 1 / 8 / 64 against 0.91x / 0.90x / 0.97x
      with float32 activations (docs/performance.md, "AVX2 int8 activations, again"); and
      byte codes that span 6 bits (Q5_0/Q5_1/Q5_K/Q6_K, ``a8_narrow_offset``: no sign trick).
      TinyLlama's Q6_K layers (Q4_K_M file), 2 threads, Zen 3: ffn_down 0.21 / 1.16 / 9.3 ms
      at 1 / 8 / 64 rows against float32's 0.39 / 2.2 / 10.0, the LM head 2.0 / 8.2 / 53
      against 2.7 / 14.3 / 58. Full-range int8 codes (int8, Q8_0) keep float32 there (their
      sign trick loses to the float32 tiles from 64 rows), and so do table codes.
    A VNNI machine's float32 layers keep float32 activations (its AVX-512 float kernels)."""
    if device.type != "cpu" or not _a8_shape_ok(qw):
        return False
    if _a8_kernel():
        return dtype == torch.bfloat16
    avx2 = dtype in (torch.float32, torch.bfloat16) and _a8_avx2()
    if not avx2 or a8_code_bits(qw, vnni=False) == 4:
        return avx2
    # narrow bytes, but not table codes (MXFP4: 4 bits a weight on the float32 kernel against
    # the 8 int8 records stream); the table's count (6 ms for 11.5M codes) only for narrow ones
    return a8_narrow_offset(qw) is not None and a8_table(qw) is None


@functools.cache
def bf16_native() -> bool:
    """Whether the kernel's bf16 activations run on bf16 dot products (AVX512-BF16,
    vdpbf16ps); elsewhere they are widened to float32 (``csrc/quant_linear.cpp``)."""
    return cpu_kernels.available() and bool(torch.ops.kvserve.quant_linear_bf16_native())


@functools.cache
def _a8_kernel() -> bool:
    """int8 activations need AVX512-VNNI (vpdpbusd) and AVX512-BF16 in the build."""
    return cpu_kernels.available() and bool(torch.ops.kvserve.quant_linear_a8_supported())


@functools.cache
def _a8_avx2() -> bool:
    """Whether the build has the AVX2 int8-activation path (vpmaddubsw; float32 and bf16)."""
    return cpu_kernels.available() and torch.ops.kvserve.quant_linear_a8_isa() == "avx2"


def wants_int8_activations(
    activations: QuantizedActivations, qw: QuantizedWeight, device: torch.device,
    dtype: torch.dtype,
) -> bool:  # fmt: skip
    """``activations`` resolved for one layer: auto is int8 exactly where the VNNI kernel
    runs (``a8_auto_supports``)."""
    if activations is QuantizedActivations.AUTO:
        return a8_auto_supports(qw, device, dtype)
    if activations is QuantizedActivations.INT8 and qw.shape[1] % 32:
        raise ValueError(
            f"int8 activations are quantized in blocks of 32, and the input size {qw.shape[1]} "
            "is not a multiple of 32 (use quantization_activations 'none')"
        )
    return activations is QuantizedActivations.INT8


class QuantLinear(nn.Module):
    """``y = x @ dequant(W)^T + b`` for a ``QuantizedWeight`` W; activations in ``dtype``, or
    quantized to int8 first (``activations``, see ``QuantizedActivations``)."""

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
        activations: QuantizedActivations = QuantizedActivations.NONE,
    ) -> None:
        super().__init__()
        if device.type == "cuda":
            # No CUDA kernel yet (issue 35): the reference path would dequantize the whole
            # weight on every call, slower than the unquantized model it replaces.
            raise ValueError(
                "quantized layers (int8, int4, GGUF, GPTQ, AWQ, compressed-tensors) run on "
                "kvserve's CPU kernels only; on CUDA every call would dequantize the whole "
                "weight. Serve an unquantized (bf16/fp16) checkpoint on CUDA, or this one "
                "with --device cpu"
            )
        self.out_features, self.in_features = qw.shape
        self.bits = qw.bits
        self.group_size = qw.group_size
        self.nbytes = qw.nbytes()
        # Plain attributes, not parameters or buffers: model.to(dtype) must not cast scales,
        # and the codes are opaque to everything but this layer.
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
        # GPTQ act-order: the kernels read the input columns in the stored order
        self.in_perm = None if qw.in_perm is None else qw.in_perm.to(device)  # [K] int64
        self.int8_activations = wants_int8_activations(activations, qw, device, dtype)
        if self.int8_activations:
            self.path = "a8" if a8_kernel_supports(qw, device, dtype) else "reference"
        else:
            self.path = "kernel" if kernel_supports(qw, device, dtype) else "reference"
        self.use_kernel = self.path != "reference"
        # float32/bf16 activations: the most rows the direct path takes before the tiled one
        # (batch-invariant mode lifts it: model/batch_invariant.py; each row's sums in the
        # direct path are one fixed sequence whatever the number of rows, the tiles' are not)
        self.direct_rows = DIRECT_ROWS
        self.qweight: QuantizedWeight | None = None
        # int8-activation kernel: how its records hold the scales
        vnni = dtype == torch.bfloat16 and _a8_kernel()
        self.scale_format = int(a8_scale_format(qw))
        self.code_bits = a8_code_bits(qw, vnni)  # the kernel's codes: 4, 5, 6 or 8 bits
        self.has_zeros = qw.zeros is not None
        if self.path == "a8":  # one buffer: scales, zeros and codes per group (pack_a8)
            # at most 16 code values (MXFP4, IQ4_NL, IQ4_XS): 4-bit indices into a table (VNNI
            # only), on per-group records: IQ4_XS's two levels as byte codes were 8.3 bits a
            # weight, per-group float32 scales with the indices 5, and faster at 1 / 8 / 64
            # rows (N 5632, K 2048, 2 threads: 0.26 / 0.39 / 2.64 ms against 0.42 / 0.54 / 2.71)
            table = a8_table(qw) if vnni else None
            if table is not None and self.scale_format == A8Scales.SUPERS:
                self.scale_format = int(a8_scale_format(qw, supers=False))
            self.codes, self.offset = pack_a8(qw, A8Scales(self.scale_format), self.code_bits,
                                              table)  # fmt: skip
            if table is not None:
                self.code_bits, self.scale_format = 4, self.scale_format | A8_TABLE
            narrow = a8_narrow_offset(qw) if not vnni and self.code_bits == 8 else None
            if narrow is not None:  # Q5_K/Q6_K on AVX2: no sign trick, 1.6x fewer operations
                self.offset, self.scale_format = narrow, self.scale_format | A8_NARROW
            self.nbytes = int(self.codes.numel())
        elif self.use_kernel:  # at most 16 code values: 4-bit indices into a table
            self.codes, self.offset, self.code_bits = pack_kernel_codes(qw)
            sdtype = a8_scale_dtype(qw)  # float16 where exact (MXFP4): the same products
            self.scales_t = _transposed(qw.scales).to(sdtype)  # [K/g, N]
            self.zeros_t = (
                torch.empty(0, dtype=sdtype)
                if qw.zeros is None
                else _transposed(qw.zeros).to(sdtype)
            )
            self.nbytes = sum(int(t.numel() * t.element_size())
                              for t in (self.codes, self.scales_t, self.zeros_t))  # fmt: skip
        else:
            logger.warning(
                "no quantized-linear kernel for %s %s: dequantizing every call (slow)",
                device,
                dtype,
            )
            self.qweight = QuantizedWeight(
                qw.codes.to(device), qw.scales.to(device),
                None if qw.zeros is None else qw.zeros.to(device), qw.bits, qw.group_size,
                self.in_perm,
            )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            ref = reference_linear_a8 if self.int8_activations else reference_linear
            return ref(x, self.qweight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.in_perm is not None:
            x2 = x2.index_select(1, self.in_perm)  # [M, K] in the stored column order
        x2 = x2.contiguous()
        out = x2.new_empty(x2.shape[0], self.out_features)  # [M, N]
        if self.path == "a8":
            torch.ops.kvserve.quant_linear_a8(
                out, x2, self.codes, self.code_bits, self.group_size, self.offset,
                self.scale_format,
                self.has_zeros,
            )  # fmt: skip
        else:
            torch.ops.kvserve.quant_linear(
                out, x2, self.codes, self.scales_t, self.zeros_t, self.code_bits, self.group_size,
                self.offset, self.direct_rows,
            )  # fmt: skip
        if self.bias is not None:
            out += self.bias
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, path={self.path}"
            + (", act-order" if self.in_perm is not None else "")
        )
