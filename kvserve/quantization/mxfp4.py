"""MXFP4 (OCP Microscaling Formats v1.0, "MX" FP4): how gpt-oss checkpoints store their
experts, dequantized at load to the model dtype, or (``--quantization mxfp4``) kept as
``QuantizedWeight``s (``mxfp4_qweight``): twice an E2M1 value is one of the integers 0, 1,
2, 3, 4, 6, 8 or 12 (signed), so a block is exactly 8-bit codes times a float32 scale
``2 ** (s - 128)`` per 32 weights, the layout GGUF's IQ4_NL already rides on the quantized
kernels (9 bits a weight in memory against bf16's 16; 4.5 on the AVX512-VNNI int8-activation
kernel, which takes such codes as 4-bit indices into a table, ``a8_table``, and the scale as
float16). GGUF files store the same blocks in their ``MXFP4`` type (``gguf_blocks``).

A block is 32 elements sharing one scale:
- each element is FP4 E2M1: a sign bit, a 2-bit exponent (bias 1) and a 1-bit mantissa,
  so the magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (exponent 0 is subnormal: ``m * 0.5``;
  otherwise ``2 ** (e - 1) * (1 + m / 2)``);
- two elements per byte, the even-indexed element in the low nibble;
- the shared scale is E8M0: an unsigned byte ``s`` meaning ``2 ** (s - 127)`` (255 is NaN).

gpt-oss checkpoints hold ``<name>_blocks [E, rows, cols / 32, 16]`` (uint8) and
``<name>_scales [E, rows, cols / 32]`` (uint8) for ``gate_up_proj`` (rows ``2I``, the gate and
up rows interleaved, cols ``H``) and ``down_proj`` (rows ``H``, cols ``I``): each expert's
matrix in the ``[out, in]`` orientation of a linear layer's weight.
"""

from __future__ import annotations

import torch

from kvserve.quantization.qweight import QuantizedWeight

BLOCK = 32  # elements per shared scale
E8M0_BIAS = 127
E8M0_NAN = 255


def fp4_e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 codes' values, ``[16]`` float32, from the format's definition."""
    codes = torch.arange(16)
    sign = torch.where(codes & 0b1000 != 0, -1.0, 1.0)
    exp, man = (codes >> 1) & 0b11, (codes & 1).float()
    normal = torch.pow(2.0, exp.float() - 1) * (1 + man / 2)
    return sign * torch.where(exp == 0, man * 0.5, normal)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")  # fmt: skip
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
            f"expected blocks [..., G, {BLOCK // 2}] and scales [..., G]"
        )
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scale 255 (NaN) in the checkpoint")


def mxfp4_qweight(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """``blocks [N, G, 16]`` uint8 and ``scales [N, G]`` uint8 (one linear weight ``[N,
    G * 32]``) -> codes ``[N, G * 32]`` int8 (twice each E2M1 value) and float32 scales
    ``[N, G]`` (``2 ** (s - 128)``, exact down to s = 0's subnormal): ``codes * scales`` is
    ``dequantize_mxfp4``'s float32 value bit for bit."""
    _check(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"MXFP4 blocks of one weight are [N, G, 16], got {tuple(blocks.shape)}")
    lut = (fp4_e2m1_values() * 2).to(torch.int8)  # [16]: 0, 1, 2, 3, 4, 6, 8, 12, -0, -1, ...
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()  # [N, G, 16] even / odd elements
    codes = torch.stack([lut[lo], lut[hi]], dim=-1).reshape(blocks.shape[0], -1)  # [N, G*32]
    scale = torch.exp2(scales.double() - (E8M0_BIAS + 1)).float()  # [N, G], exact powers of 2
    return QuantizedWeight(codes, scale, None, bits=8, group_size=BLOCK)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in
    ``dtype`` (every value is exact in bf16 and float32 for scales within their range)."""
    _check(blocks, scales)
    lut = fp4_e2m1_values()
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()  # [..., G, 16] even / odd elements
    values = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # [..., G, 32]
    scale = torch.pow(2.0, scales.float() - E8M0_BIAS).unsqueeze(-1)  # [..., G, 1]
    return (values * scale).flatten(-2).to(dtype)
