"""Quantized weights as plain data: integer codes and a scale (and zero) per group along K.

One format holds every kind of weight-only quantization kvserve runs: its own round-to-nearest
int8/int4 (``quantize_rtn``) and the GGUF types it keeps quantized (``gguf_weights.py``). A
weight ``W[N, K]`` is ``codes[n, k] * scales[n, k // g] + zeros[n, k // g]``, computed in
float32 (multiply, then add). The fast kernel (``qlinear.py``, ``csrc/quant_linear.cpp``) and
the reference (``dequantize``) compute exactly that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPER_BLOCK = 256  # weights along K that share a GGUF K-quant's d (and dmin)


@dataclass(frozen=True)
class SuperScales:
    """A GGUF K-quant's scales as the file stores them (Q2_K..Q6_K, IQ4_XS): per super-block
    of 256 along K a float16 ``d`` (and ``dmin``), per group a small integer ``sc`` (and
    ``m``), so that ``scale = float32(d) * sc`` and ``zero = -(float32(dmin) * m)`` are the
    ``QuantizedWeight``'s float32 scales and zeros exactly. The int8-activation kernel reads
    these (``pack_a8``'s super-block records) instead of a float32 scale and zero per group:
    a Q4_K weight then streams 4.6 bits per weight instead of 6, a Q6_K one 8.6 instead of 10.
    """

    d: torch.Tensor  # [N, K / 256] float16
    sc: torch.Tensor  # [N, K / g] int8
    dmin: torch.Tensor | None  # [N, K / 256] float16; None: no zeros
    m: torch.Tensor | None  # [N, K / g] int8, with dmin

    def check(self, n: int, k: int, group_size: int, zeros: bool) -> None:
        """Raise unless the shapes fit ``n x k`` weights in groups of ``group_size``."""
        if k % SUPER_BLOCK or SUPER_BLOCK % group_size:
            raise ValueError(f"super-block scales need K ({k}) in blocks of {SUPER_BLOCK} "
                             f"and groups ({group_size}) that divide one")  # fmt: skip
        if (self.dmin is None) != (self.m is None) or (self.dmin is not None) != zeros:
            raise ValueError("super-block dmin and m go together, exactly when there are zeros")
        for t, width, dtype in ((self.d, SUPER_BLOCK, torch.float16),
                                (self.sc, group_size, torch.int8),
                                (self.dmin, SUPER_BLOCK, torch.float16),
                                (self.m, group_size, torch.int8)):  # fmt: skip
            if t is not None and (t.shape != (n, k // width) or t.dtype != dtype):
                raise ValueError(f"super-block scales: {tuple(t.shape)} {t.dtype}, expected "
                                 f"{(n, k // width)} {dtype}")  # fmt: skip

    def scales(self) -> torch.Tensor:
        """The float32 scale of every group ``[N, K / g]``: d * sc, rounded once."""
        return self._widen(self.d) * self.sc.float()

    def zeros(self) -> torch.Tensor | None:
        """The float32 zero of every group, -(dmin * m), or None."""
        if self.dmin is None or self.m is None:
            return None
        return -(self._widen(self.dmin) * self.m.float())

    def _widen(self, per_block: torch.Tensor) -> torch.Tensor:
        reps = self.sc.shape[1] // per_block.shape[1]  # groups per super-block
        return per_block.float().repeat_interleave(reps, dim=1)

    def rows(self, index: torch.Tensor | slice) -> SuperScales:
        """The same rows of each field (a permutation or a slice of output channels)."""
        return SuperScales(*(None if t is None else t[index].contiguous()
                             for t in (self.d, self.sc, self.dmin, self.m)))  # fmt: skip


# int4 codes are any 16 consecutive integers starting at one of these: -8 (symmetric:
# kvserve's RTN, GGUF Q4_0) or 0 (with a zero point: GGUF Q4_1, Q4_K).
INT4_RANGES = ((-8, 7), (0, 15))


@dataclass
class QuantizedWeight:
    """``W[n, k] = codes[n, k] * scales[n, k // g] (+ zeros[n, k // g])``."""

    codes: torch.Tensor  # [N, K] int8: the integer codes (int4 ones within an INT4_RANGES range)
    scales: torch.Tensor  # [N, K // g] float32 or float16 (the stored precision)
    zeros: torch.Tensor | None  # [N, K // g] like scales; None: 0
    bits: int  # 8 or 4: how many bits the codes need
    group_size: int  # g: weights per scale along K (K itself: one scale per output channel)
    # [K] int64 or None: the columns are stored in this order (GPTQ activation order puts a
    # group's columns anywhere; sorted, they are contiguous): the layer computes
    # x[:, in_perm] @ W^T, and the checkpoint's column in_perm[j] is stored column j.
    in_perm: torch.Tensor | None = None
    # GGUF K-quants: the scales' and zeros' two-level form, which the int8-activation kernel
    # streams instead of the float32 values (None: not a K-quant, or lost in a fusion)
    supers: SuperScales | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 4 or 8 bits, got {self.bits}")
        check_group_size(self.group_size, k)
        if self.scales.shape != (n, k // self.group_size):
            raise ValueError(
                f"scales of shape {tuple(self.scales.shape)} do not fit {n} x {k} weights in "
                f"groups of {self.group_size}"
            )
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError("zeros must have the shape of scales")
        if self.in_perm is not None and self.in_perm.shape != (k,):
            raise ValueError("in_perm must hold one index per input column")
        if self.supers is not None:
            self.supers.check(n, k, self.group_size, self.zeros is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``, in the checkpoint's column order: the
        pure-PyTorch reference of every kernel."""
        g = self.group_size
        w = self.codes.float() * self.scales.float().repeat_interleave(g, dim=1)  # [N, K]
        if self.zeros is not None:
            w = w + self.zeros.float().repeat_interleave(g, dim=1)
        if self.in_perm is not None:
            w = w[:, torch.argsort(self.in_perm)]  # stored column j back to in_perm[j]
        return w.to(dtype)

    def exact(self) -> torch.Tensor:
        """The weight ``[N, K]`` computed in float64 (no float32 rounding of code * scale +
        zero), in the stored column order (see ``in_perm``): the exact value the
        int8-activation reference multiplies with."""
        g = self.group_size
        w = self.codes.double() * self.scales.double().repeat_interleave(g, dim=1)  # [N, K]
        if self.zeros is not None:
            w = w + self.zeros.double().repeat_interleave(g, dim=1)
        return w

    def nbytes(self) -> int:
        """Bytes the weight takes in memory once packed for the kernel."""
        n, k = self.shape
        per_scale = self.scales.element_size() * (2 if self.zeros is not None else 1)
        return n * k * self.bits // 8 + self.scales.numel() * per_scale


def check_group_size(group_size: int, k: int) -> None:
    """A group size must be a positive even number dividing the input size K."""
    if group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(
            f"quantization group size {group_size} must be even and divide the layer's input "
            f"size {k} (e.g. 32, 64 or 128)"
        )


def quantize_rtn(
    w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool | None = None
) -> QuantizedWeight:
    """Round-to-nearest quantization of ``w [N, K]``, scales (and zeros) stored as float16
    (as GGUF stores them), the codes computed with the rounded values.

    int8 (symmetric by default): scale = max|w| / 127 per group, codes in [-127, 127]. int4
    (asymmetric by default): llama.cpp's Q4_1 rule, scale = (max - min) / 15 and zero = min per
    group, codes in [0, 15]. The symmetric Q4_0 rule (``symmetric=True``: scale = the value
    of largest magnitude / -8, codes clamped to [-8, 7]) raised the built-in model's
    perplexity 23% (benchmarks/quant_quality.py); that model's weights are Q4_1 values, which
    this rule gives back. ``group_size`` None is
    one group per output channel.
    """
    n, k = w.shape
    g = k if group_size is None else group_size
    check_group_size(g, k)
    if bits not in (4, 8):
        raise ValueError(f"quantize_rtn takes 8 or 4 bits, got {bits}")
    sym = (bits == 8) if symmetric is None else symmetric
    groups = w.detach().float().reshape(n, k // g, g)  # [N, K/g, g]
    zero = None
    if sym and bits == 8:
        scale = groups.abs().amax(dim=-1) / 127.0
        lo, hi = -127, 127
    elif sym:
        idx = groups.abs().argmax(dim=-1, keepdim=True)
        scale = groups.gather(-1, idx).squeeze(-1) / -8.0
        lo, hi = -8, 7
    else:
        top = 2**bits - 1
        low = groups.amin(dim=-1)
        scale = (groups.amax(dim=-1) - low) / top
        zero = low.to(torch.float16)
        lo, hi = 0, top
    scale = scale.to(torch.float16)
    if not torch.isfinite(scale).all() or (zero is not None and not torch.isfinite(zero).all()):
        raise ValueError("weights too large for float16 scales (|w| > 65504)")
    s = scale.float().unsqueeze(-1)  # [N, K/g, 1]
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    shifted = groups if zero is None else groups - zero.float().unsqueeze(-1)
    codes = torch.clamp(torch.round(shifted * inv), lo, hi).to(torch.int8).reshape(n, k)
    return QuantizedWeight(codes, scale, zero, bits, g)


def relative_error(w: torch.Tensor, qw: QuantizedWeight) -> float:
    """``||W - dequant(W)|| / ||W||`` (Frobenius), the figure the loader records per layer."""
    ref = w.detach().float()
    denom = float(ref.norm())
    return float((ref - qw.dequantize()).norm()) / denom if denom else 0.0


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along N (fused QKV, gate/up) into one; groups are refined to the
    smallest group size, zeros materialised where any part has them, and int4 codes moved
    into one common range (the zero absorbs the shift: equal values up to float32 rounding)."""
    k = parts[0].shape[1]
    if any(p.shape[1] != k for p in parts):
        raise ValueError("fused weights must share their input size")
    perm = parts[0].in_perm
    if any((p.in_perm is None) != (perm is None) for p in parts) or (
        perm is not None and any(not torch.equal(p.in_perm, perm) for p in parts)  # type: ignore[arg-type]
    ):
        raise ValueError("fused weights must share their column order (GPTQ act-order: the "
                         "parts of a fused projection need one g_idx order)")  # fmt: skip
    g = math.gcd(*(p.group_size for p in parts))
    bits = max(p.bits for p in parts)
    fp32 = any(p.scales.dtype == torch.float32 for p in parts)
    sdtype = torch.float32 if fp32 else torch.float16
    with_zeros = any(p.zeros is not None for p in parts)
    # int4 parts must share one code range: shift [0, 15] codes to [-8, 7] if ranges differ.
    shift_unsigned = bits == 4 and len({int(p.codes.min() >= 0) for p in parts}) > 1
    codes, scales, zeros = [], [], []
    for p in parts:
        rep = p.group_size // g
        s = p.scales.repeat_interleave(rep, dim=1)
        z = None if p.zeros is None else p.zeros.repeat_interleave(rep, dim=1)
        c = p.codes
        if shift_unsigned and p.bits == 4 and int(c.min()) >= 0:
            c = c - 8  # value = (c - 8) * s + (z + 8 s)
            z = (z if z is not None else torch.zeros_like(s)).float() + 8 * s.float()
            sdtype = torch.float32
            with_zeros = True
        codes.append(c)
        scales.append(s)
        zeros.append(z)
    if with_zeros:
        pairs = zip(zeros, scales, strict=True)
        filled = [torch.zeros_like(s) if z is None else z for z, s in pairs]
        zero_t: torch.Tensor | None = torch.cat([z.to(sdtype) for z in filled])
    else:
        zero_t = None
    scale_t = torch.cat([s.to(sdtype) for s in scales])
    supers = None if shift_unsigned else concat_supers(parts, g, with_zeros)
    if supers is not None:  # the same values; zeros' signs as the kernel computes them
        scale_t, zero_t = supers.scales(), supers.zeros()
    return QuantizedWeight(torch.cat(codes), scale_t, zero_t, bits, g, perm, supers)


def concat_supers(parts: list[QuantizedWeight], g: int, zeros: bool) -> SuperScales | None:
    """The parts' super-block scales stacked along N, groups refined to ``g`` (a part without
    zeros gets dmin = m = 0), or None unless every part has them."""
    sups = [p.supers for p in parts]
    if any(s is None for s in sups):
        return None
    d, sc, dmin, m = [], [], [], []
    for p, sup in zip(parts, sups, strict=True):
        assert sup is not None
        rep = p.group_size // g
        d.append(sup.d)
        sc.append(sup.sc.repeat_interleave(rep, dim=1))
        dmin.append(torch.zeros_like(sup.d) if sup.dmin is None else sup.dmin)
        m.append(torch.zeros_like(sc[-1]) if sup.m is None else sup.m.repeat_interleave(rep, 1))
    if not zeros:
        return SuperScales(torch.cat(d), torch.cat(sc), None, None)
    return SuperScales(torch.cat(d), torch.cat(sc), torch.cat(dmin), torch.cat(m))
