"""GGUF quantized blocks as integer codes plus a scale (and zero) per group.

Each block type kvserve keeps quantized maps exactly onto ``QuantizedWeight``'s
``codes * scale (+ zero)``, computed as ``gguf.quants.dequantize`` computes it (float32
multiply, then add; ``a - b`` is ``a + (-b)`` exactly), so the values are gguf's own bit for
bit (tests/quantization/test_gguf_weights.py holds every type to it):

| type | group | codes | value | scales (zeros) |
|---|---|---|---|---|
| Q8_0 | 32 | int8 | d * q | float16 d |
| Q4_0 | 32 | q - 8 in [-8, 7] | d * (q - 8) | float16 d |
| Q4_1 | 32 | q in [0, 15] | d * q + m | float16 d, m |
| Q5_0 | 32 | q - 16 in [-16, 15] (int8) | d * (q - 16) | float16 d |
| Q5_1 | 32 | q in [0, 31] (int8) | d * q + m | float16 d, m |
| Q2_K | 16 (of 256) | q in [0, 3] (int4) | (d * sc) * q - dmin * mn | float32 |
| Q3_K | 16 (of 256) | q - 4 (hmask) in [-4, 3] (int4) | (d * (sc - 32)) * q | float32 |
| Q4_K | 32 (of 256) | q in [0, 15] | (d * sc) * q - dmin * mn | float32 |
| Q5_K | 32 (of 256) | q in [0, 31] (int8) | (d * sc) * q - dmin * mn | float32 |
| Q6_K | 16 (of 256) | q - 32 in [-32, 31] (int8) | (d * sc) * (q - 32) | float32 |
| IQ4_NL | 32 | kvalues[q] in [-127, 113] (int8) | d * kvalues[q] | float16 d |
| IQ4_XS | 32 (of 256) | kvalues[q] (int8) | (d * (ls - 32)) * kvalues[q] | float32 |
| MXFP4 | 32 | 2 * E2M1[q] in [-12, 12] (int8) | d * (2 * E2M1[q]) | float32 d = 2^(e - 128) |

MXFP4 (gpt-oss's experts: one E8M0 byte per 32 values, ``e8m0_to_fp32_half``) holds its
values exactly as ``quantization/mxfp4.mxfp4_qweight`` holds a safetensors checkpoint's (the
same codes and scales; only the nibble order within a block differs: low nibbles are elements
0..15 here, even elements there).

The 5-bit types and the IQ4 lookups ride the int8 codes, the 2- and 3-bit K-quants the int4
ones: the kernels' tests cover each (bits, group, zeros) combination used here. Where the
int8-activation kernel runs on AVX512-VNNI (bf16), it streams about the file's bytes instead
(``qlinear.pack_a8``): 5- and 6-bit codes as nibbles plus bit planes, and the K-quants' scales
in their two levels (the fourth element of ``Decoded``, ``qweight.SuperScales``): Q4_K 4.625
bits per weight in memory (4.5 in the file), Q5_K 5.625 (5.5), Q6_K 6.5625 (6.5625), Q5_0
5.5 (5.5); per-group float32 scales elsewhere (Q4_K 6, Q5_K and Q6_K 10).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL, MXFP4, Q4_K

T = GGMLQuantizationType

# type -> (group size, bits of the codes' packing)
LAYOUTS: dict[T, tuple[int, int]] = {
    T.Q8_0: (32, 8), T.Q4_0: (32, 4), T.Q4_1: (32, 4), T.Q5_0: (32, 8), T.Q5_1: (32, 8),
    T.Q2_K: (16, 4), T.Q3_K: (16, 4), T.Q4_K: (32, 4), T.Q5_K: (32, 8), T.Q6_K: (16, 8),
    T.IQ4_NL: (32, 8), T.IQ4_XS: (32, 8), T.MXFP4: (32, 8),
}  # fmt: skip
SUPPORTED_TYPES = tuple(LAYOUTS)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
_KVALUES = np.array(IQ4_NL.kvalues, dtype=np.int8)  # IQ4's 16 non-linear levels
_E2M1X2 = np.array(MXFP4.kvalues, dtype=np.int8)  # twice the 16 FP4 E2M1 values


def _pair_table(levels: np.ndarray) -> np.ndarray:
    """``[256]`` little-endian int16: byte ``b`` -> its two nibbles' levels, the low nibble's
    in the low byte (one lookup per byte instead of a split into nibbles and one per nibble:
    3.5x faster on a gpt-oss expert's 8.3M bytes, 12 against 43 ms)."""
    b = np.arange(256)
    pairs = np.stack([levels[b & 15], levels[b >> 4]], axis=-1)  # [256, 2] int8
    return np.ascontiguousarray(pairs).view("<i2").reshape(256)


_KVALUES_PAIRS = _pair_table(_KVALUES)
_E2M1X2_PAIRS = _pair_table(_E2M1X2)


def _levels(pairs: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """``[nb, 16]`` bytes -> ``[nb, 32]`` levels: low nibbles are elements 0..15, high 16..31
    (``_nibbles``' order), through a ``_pair_table``."""
    both = pairs[qs].view(np.int8).reshape(-1, 16, 2)  # [nb, 16, (low, high)]
    return both.transpose(0, 2, 1).reshape(-1, 32)


# A K-quant's two levels (qweight.SuperScales): d [nb] float16, sc [nb, groups] int8, and
# dmin, m likewise or None
Supers = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
# codes [E] int8, scales [E/g], zeros [E/g] or None, supers or None (not a K-quant)
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None, Supers | None]


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).reshape(-1)


def _two_level(
    d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None = None, mn: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None, Supers]:
    """Scales d * sc and zeros -(dmin * mn) per group (float32, as gguf computes them) from a
    block's float16 ``d`` / ``dmin`` columns ``[nb, 2]`` bytes and integer ``sc`` / ``mn``
    ``[nb, groups]``; and the two levels themselves."""
    scales = (_f32(d) * sc.astype(np.float32)).reshape(-1)
    sc8 = sc.astype(np.int8)
    if dmin is None or mn is None:
        return scales, None, (_f16(d), sc8, None, None)
    zeros = -(_f32(dmin) * mn.astype(np.float32)).reshape(-1)
    return scales, zeros, (_f16(d), sc8, _f16(dmin), mn.astype(np.int8))


def _f32(col: np.ndarray) -> np.ndarray:
    """A block's float16 field as float32 ``[nb, 1]``, for the super-block scale products."""
    return _f16(col).astype(np.float32)[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[nb, 16]`` bytes -> ``[nb, 32]`` codes: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """``[..., n]`` bytes -> ``[..., count, n]``: field i is bits ``width * i`` up."""
    shifts = np.arange(0, width * count, width, dtype=np.uint8).reshape(count, 1)
    return (packed[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _legacy(raw: np.ndarray, qtype: T) -> Decoded:
    """The 32-value block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL."""
    if qtype == T.Q8_0:
        b = raw.reshape(-1, 34)
        return b[:, 2:].copy().view(np.int8).reshape(-1), _f16(b[:, :2]), None, None
    if qtype == T.Q4_0:
        b = raw.reshape(-1, 18)
        q4 = (_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).reshape(-1)
        return q4, _f16(b[:, :2]), None, None
    if qtype == T.Q4_1:
        b = raw.reshape(-1, 20)
        q4 = _nibbles(b[:, 4:]).astype(np.int8).reshape(-1)
        return q4, _f16(b[:, :2]), _f16(b[:, 2:4]), None
    if qtype == T.IQ4_NL:
        b = raw.reshape(-1, 18)
        return _levels(_KVALUES_PAIRS, b[:, 2:]).reshape(-1), _f16(b[:, :2]), None, None
    # Q5_0 / Q5_1: a uint32 of fifth bits (bit j: element j), then the nibbles as Q4_x
    head = 2 if qtype == T.Q5_0 else 4
    b = raw.reshape(-1, head + 20)
    qh = np.ascontiguousarray(b[:, head : head + 4]).view(np.uint32)  # [nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [nb, 32]
    q = (_nibbles(b[:, head + 4 :]) | (high << 4)).astype(np.int8)  # [nb, 32] in [0, 31]
    if qtype == T.Q5_0:
        return (q - np.int8(16)).reshape(-1), _f16(b[:, :2]), None, None
    return q.reshape(-1), _f16(b[:, :2]), _f16(b[:, 2:4]), None


def _q2_k(raw: np.ndarray) -> Decoded:
    b = raw.reshape(-1, 84)
    sc = b[:, :16]  # [nb, 16]: scale in the low nibble, min in the high one
    scales, zeros, supers = _two_level(b[:, 80:82], sc & 0x0F, b[:, 82:84], sc >> 4)
    q = _bits(b[:, 16:80].reshape(-1, 2, 32), 2, 4)  # [nb, 2, 4, 32]: 16 groups of 16
    return q.astype(np.int8).reshape(-1), scales, zeros, supers


def _q3_k(raw: np.ndarray) -> Decoded:
    b = raw.reshape(-1, 110)
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = _bits(packed[:, :8], 4, 2).reshape(-1, 16)  # [nb, 16]: low 4 bits of each scale
    high = _bits(packed[:, 8:12], 2, 4).reshape(-1, 16)  # and its top 2
    sc = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [nb, 16]
    scales, _, supers = _two_level(b[:, 108:110], sc)
    ql = _bits(qs.reshape(-1, 2, 32), 2, 4).reshape(-1, 16, 16)
    qh = _bits(hmask, 1, 8).reshape(-1, 16, 16) ^ np.uint8(1)  # a clear bit subtracts 4
    q = ql.astype(np.int8) - (qh << 2).astype(np.int8)  # [nb, 16, 16] in [-4, 3]
    return q.reshape(-1), scales, None, supers


def _q45_k(raw: np.ndarray, qtype: T) -> Decoded:
    """Q4_K and Q5_K: 8 groups of 32, 6-bit scales and mins (Q4_K.get_scale_min)."""
    size = 144 if qtype == T.Q4_K else 176
    b = raw.reshape(-1, size)
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [nb, 8] each
    scales, zeros, supers = _two_level(b[:, 0:2], sc, b[:, 2:4], mn)
    qs = b[:, size - 128 :].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: groups 2c and 2c + 1
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # [nb, 8, 32]
    if qtype == T.Q5_K:  # group s's fifth bits: bit s of the 32 qh bytes
        q = q | (_bits(b[:, 16:48], 1, 8) << 4)
    return q.astype(np.int8).reshape(-1), scales, zeros, supers


def _q6_k(raw: np.ndarray) -> Decoded:
    b = raw.reshape(-1, 210)
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8)  # [nb, 16]
    # two halves of 128 values: ql's 64 bytes give values 0..63 (low nibbles) and
    # 64..127 (high); qh's 32 bytes give bits 4-5 of values 0..31, 32..63, 64.., 96..
    low = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2)
    high = _bits(qh.reshape(-1, 2, 32), 2, 4)  # [nb, 2, 4, 32]
    q = low.reshape(-1, 2, 4, 32) | (high << 4)
    scales, _, supers = _two_level(b[:, 208:210], sc)
    return q.astype(np.int8).reshape(-1) - np.int8(32), scales, None, supers


def _iq4_xs(raw: np.ndarray) -> Decoded:
    b = raw.reshape(-1, 136)
    high = _bits(np.ascontiguousarray(b[:, 2:4]).view(np.uint16), 2, 8)  # [nb, 8, 1]
    low = _bits(b[:, 4:8], 4, 2).transpose(0, 2, 1).reshape(-1, 8)  # group 2i: byte i's low
    ls = (low | (high.reshape(-1, 8).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    scales, _, supers = _two_level(b[:, 0:2], ls)  # [nb, 8] groups
    q = _levels(_KVALUES_PAIRS, b[:, 8:].reshape(-1, 16))  # [nb * 8, 32]: low, then high
    return q.reshape(-1), scales, None, supers


def _mxfp4(raw: np.ndarray) -> Decoded:
    b = raw.reshape(-1, 17)  # an E8M0 exponent byte, then 16 bytes of nibbles
    scales = MXFP4.e8m0_to_fp32_half(b[:, 0]).astype(np.float32)  # [nb]: 2^(e - 128)
    return _levels(_E2M1X2_PAIRS, b[:, 1:]).reshape(-1), scales, None, None


def decode_blocks(raw: np.ndarray, qtype: T) -> Decoded:
    """One tensor's blocks (uint8) -> codes ``[E]`` int8, scales and zeros ``[E / g]``, and
    a K-quant's two levels of scales (else None)."""
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL):
        return _legacy(raw, qtype)
    if qtype == T.Q2_K:
        return _q2_k(raw)
    if qtype == T.Q3_K:
        return _q3_k(raw)
    if qtype in (T.Q4_K, T.Q5_K):
        return _q45_k(raw, qtype)
    if qtype == T.Q6_K:
        return _q6_k(raw)
    if qtype == T.IQ4_XS:
        return _iq4_xs(raw)
    if qtype == T.MXFP4:
        return _mxfp4(raw)
    raise ValueError(f"GGUF type {qtype.name} has no quantized layer in kvserve")
