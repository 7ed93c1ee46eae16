"""GPTQ checkpoints (``quant_method: gptq``): the int32-packed layout AutoGPTQ and GPTQModel
write, the one behind most ``-GPTQ`` / ``-GPTQ-Int4`` checkpoints and vLLM's ``gptq``.

Per linear layer, ``W[N, K]`` with groups of g along K:
  ``qweight [K / p, N]`` int32, p = 32 / bits codes a word, code j of word r is row ``p r + j``
  (bits ``bits * j`` up);
  ``qzeros [K / g, N / p]`` int32, zero j of word c is column ``p c + j``;
  ``scales [K / g, N]`` float16; ``g_idx [K]``: each row's group;
  ``W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``.
In the original ("v1", ``checkpoint_format: gptq``) format every stored zero is one less than
the zero used, taken off the packed word as a whole (GPTQModel subtracts 0x11111111 for 4 bits),
so it is added back the same way; ``gptq_v2`` stores them as they are.

These load into kvserve's int4/int8 layers as they are: codes ``q - 2^(bits-1)``, the same
scales, and zeros only where a zero is not ``2^(bits-1)`` (symmetric checkpoints, the usual
kind, have none). Activation order (``desc_act``) with a permuted ``g_idx`` puts each row's
group anywhere: the rows are stored sorted by group (``QuantizedWeight.in_perm``) and the
layer gathers its input columns in that order first (q/k/v and gate/up share their input,
so GPTQ gives them one order, and they fuse). 2- and 3-bit codes and repacked layouts
(Marlin, ...) are refused. No library kvserve depends on reads this format
(GPTQModel, which does, is a large install with kernels of its own), so the unpacking is here,
checked against GPTQModel's packing and dequantization rules in ``tests/engine/test_gptq.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quantization.qweight import QuantizedWeight

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: v1 (zeros stored minus one) and v2
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def gptq_config(raw: dict[str, Any]) -> tuple[str, int, int | None, bool]:
    """(checkpoint format, bits, group size or None for one group per channel, sym) of a
    GPTQ ``quantization_config``; a clear ValueError for what kvserve cannot run."""
    bits = raw.get("bits")
    fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if bits not in (4, 8):
        raise ValueError(f"GPTQ checkpoint with {bits}-bit codes: kvserve runs 4 and 8 bits")
    if fmt not in FORMATS:
        raise ValueError(f"GPTQ checkpoint format {fmt!r}: kvserve loads {FORMATS} (not "
                         "repacked layouts such as Marlin)")  # fmt: skip
    group = int(raw.get("group_size", -1))
    return fmt, int(bits), group if group > 0 else None, bool(raw.get("sym", True))


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``words`` as their codes (least significant first), spread along ``dim``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits)
    words = words.long() & 0xFFFFFFFF  # the unsigned 32-bit word
    if dim == 0:  # [R, C] -> [R * per, C]
        codes = words.unsqueeze(1) >> shifts.view(1, per, 1)
        return (codes & ((1 << bits) - 1)).reshape(words.shape[0] * per, words.shape[1])
    codes = words.unsqueeze(2) >> shifts.view(1, 1, per)  # [R, C] -> [R, C * per]
    return (codes & ((1 << bits) - 1)).reshape(words.shape[0], words.shape[1] * per)


def gptq_weight(params: dict[str, torch.Tensor], fmt: str, bits: int, name: str) -> QuantizedWeight:
    """One layer's ``qweight``/``qzeros``/``scales`` (/``g_idx``) as a ``QuantizedWeight``."""
    qweight, qzeros, scales = params["qweight"], params["qzeros"], params["scales"]
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    g = k // scales.shape[0]
    contiguous = torch.arange(k) // g
    g_idx = params.get("g_idx")
    perm = None  # act-order: stored column j is the checkpoint's column perm[j]
    if g_idx is not None and not torch.equal(g_idx.long(), contiguous):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], contiguous):
            raise ValueError(f"{name}: GPTQ g_idx does not put {g} columns in each of "
                             f"{scales.shape[0]} groups")  # fmt: skip
    if fmt == "gptq":  # v1: each zero was stored minus one, off the whole word
        ones = sum(1 << (bits * j) for j in range(32 // bits))  # 0x11111111 for 4 bits
        qzeros = qzeros.long() + ones  # (_unpack takes it mod 2^32, as it was stored)
    q = _unpack(qweight, bits, 0)  # [K, N]
    if perm is not None:
        q = q[perm]  # each group's rows together: [K, N] in the stored order
    zero = _unpack(qzeros, bits, 1)[:, :n]  # [K / g, N]
    half = 1 << (bits - 1)
    scale = scales.float().t().contiguous()  # [N, K / g]
    zeros = None
    if not bool((zero == half).all()):
        zeros = -((zero.t() - half).float() * scale)  # (q - z) s = (q - h) s - (z - h) s
    codes = (q.t() - half).to(torch.int8).contiguous()  # [N, K]
    return QuantizedWeight(codes, scale, zeros, bits, g, perm)
