"""GGUF quantized tensors as ``QuantizedWeight``s, without going through a float weight.

Each GGUF block type maps exactly onto codes plus a scale (and zero) per group, computed the
way ``gguf.quants.dequantize`` computes it (tests check the values are identical):

| type | group | codes | value | scales |
|---|---|---|---|---|
| Q8_0 | 32 | int8 | d * q | float16 d |
| Q4_0 | 32 | q - 8 in [-8, 7] | d * (q - 8) | float16 d |
| Q4_1 | 32 | q in [0, 15] | d * q + m | float16 d, m |
| Q4_K | 32 (of a 256 super-block) | q in [0, 15] | (d * sc) * q - dmin * mn | float32 |
| Q6_K | 16 (of a 256 super-block) | q - 32 in [-32, 31] (int8) | (d * sc) * (q - 32) | float32 |

llama.cpp stores ``attn_q``/``attn_k`` rows of ``llama`` files in its rotary order; rows are
unpermuted as the float converter does (``gguf_convert.unpermute_rotary``), codes and scales
alike. ``qwen2`` / ``qwen3`` files keep HF's row order (llama.cpp does not permute them).

``GGUFLinears`` decodes one fused module at a time (``take``), reading its tensors with plain
reads: the loader builds each quantized layer as its turn comes, so neither the whole set of
decoded weights nor the file's pages (a memory map's touched pages count in the process's RSS
until it is unmapped) are ever held at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K
from transformers import PretrainedConfig

from kvserve.model.gguf_convert import (
    _BLOCK_NAME_RE,
    _BLOCK_TENSOR_MAP,
    read_bytes,
    unpermute_rotary,
)
from kvserve.model.gguf_metadata import read_architecture
from kvserve.quantization.fusion import fused_modules
from kvserve.quantization.qweight import QuantizedWeight, concat_rows

T = GGMLQuantizationType
SUPPORTED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[nb, 16]`` bytes -> ``[nb, 32]`` codes: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_blocks(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One tensor's blocks (uint8) -> codes ``[E]`` int8, scales and zeros ``[E / g]``."""
    if qtype == T.Q8_0:
        b = raw.reshape(-1, 34)
        return b[:, 2:].copy().view(np.int8).reshape(-1), _f16(b[:, :2]), None
    if qtype == T.Q4_0:
        b = raw.reshape(-1, 18)
        codes = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
        return codes.reshape(-1), _f16(b[:, :2]), None
    if qtype == T.Q4_1:
        b = raw.reshape(-1, 20)
        return _nibbles(b[:, 4:]).astype(np.int8).reshape(-1), _f16(b[:, :2]), _f16(b[:, 2:4])
    if qtype == T.Q4_K:
        b = raw.reshape(-1, 144)
        d = _f16(b[:, 0:2]).astype(np.float32)[:, None]  # [nb, 1]
        dmin = _f16(b[:, 2:4]).astype(np.float32)[:, None]
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [nb, 8] each
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c and 2c + 1
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1)  # [nb * 256]
        scales = (d * sc.astype(np.float32)).reshape(-1)
        zeros = -(dmin * mn.astype(np.float32)).reshape(-1)
        return codes.astype(np.int8), scales, zeros
    if qtype == T.Q6_K:
        b = raw.reshape(-1, 210)
        ql, qh = b[:, :128], b[:, 128:192]
        sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [nb, 16]
        d = _f16(b[:, 208:210]).astype(np.float32)[:, None]
        # two halves of 128 values: ql's 64 bytes give values 0..63 (low nibbles) and
        # 64..127 (high); qh's 32 bytes give bits 4-5 of values 0..31, 32..63, 64.., 96..
        low = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = (qh.reshape(-1, 2, 1, 32) >> shifts) & 0x03  # [nb, 2, 4, 32]
        q = low.reshape(-1, 2, 4, 32) | (high << 4)
        codes = q.astype(np.int8).reshape(-1) - np.int8(32)
        return codes, (d * sc).reshape(-1), None
    raise ValueError(f"GGUF type {qtype.name} has no quantized layer in kvserve")


GROUP_SIZES = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_1: 32, T.Q4_K: 32, T.Q6_K: 16}


def check_supported(name: str, qtype: T) -> None:
    """Refuse, by name, a GGUF tensor type that has no quantized layer in kvserve."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has type {qtype.name}, which --quantization gguf cannot keep "
            f"quantized; supported: {[t.name for t in SUPPORTED_TYPES]} (or load the file "
            "without --quantization: it is then dequantized)"
        )


def tensor_to_qweight(name: str, qtype: T, raw: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor of ``n`` rows of ``k`` values as a ``QuantizedWeight``."""
    check_supported(name, qtype)
    g = GROUP_SIZES[qtype]
    codes, scales, zeros = decode_blocks(np.asarray(raw, dtype=np.uint8).reshape(-1), qtype)

    def rows(a: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(n, width)

    return QuantizedWeight(
        codes=rows(codes, k),
        scales=rows(scales, k // g),
        zeros=None if zeros is None else rows(zeros, k // g),
        bits=4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8,
        group_size=g,
    )


def _unpermute(qw: QuantizedWeight, heads: int) -> QuantizedWeight:
    z = None if qw.zeros is None else unpermute_rotary(qw.zeros, heads).contiguous()
    return QuantizedWeight(
        unpermute_rotary(qw.codes, heads).contiguous(),
        unpermute_rotary(qw.scales, heads).contiguous(),
        z, qw.bits, qw.group_size,
    )  # fmt: skip


@dataclass(frozen=True)
class _Tensor:
    """Where one quantized projection lies in the file, and how to decode it."""

    name: str  # the GGUF name (blk.3.attn_q.weight)
    qtype: T
    offset: int  # of its blocks, from the file's start
    nbytes: int
    n: int  # rows (output features)
    k: int  # values per row (input features)
    heads: int | None  # heads to unpermute the rows over (attn_q, attn_k), else None


class GGUFLinears:
    """The decoder layers' quantized projections of a llama-family GGUF, fused as kvserve's model
    fuses them. ``modules``: kvserve module path (``layers.3.self_attn.qkv_proj``) -> its
    parts; ``checkpoint_names``: the converted folder's tensors they stand for
    (``model.layers.3.self_attn.q_proj.weight``), which the loader need not read.
    Projections stored as floats (F32/F16/BF16) are left out: they stay ordinary layers."""

    def __init__(self, path: str | Path, config: PretrainedConfig) -> None:
        self.path = Path(path)
        reader = GGUFReader(str(path))  # the header only: tensor data is read in take()
        self._tensors: dict[str, _Tensor] = {}  # by projection (layers.3.self_attn.q_proj)
        floats: set[str] = set()
        heads = {"q_proj": int(config.num_attention_heads),
                 "k_proj": int(config.num_key_value_heads)}  # fmt: skip
        if read_architecture(reader) != "llama":
            heads = {}  # only llama files have permuted q/k rows
        for tensor in reader.tensors:
            match = _BLOCK_NAME_RE.match(tensor.name)
            if match is None or match.group(2) not in _BLOCK_TENSOR_MAP:
                continue
            hf = _BLOCK_TENSOR_MAP[match.group(2)].format(i=int(match.group(1)))
            module = hf.removeprefix("model.").removesuffix(".weight")
            proj = module.split(".")[-1]
            if not proj.endswith("_proj"):
                continue  # norms
            if tensor.tensor_type in FLOAT_TYPES:
                floats.add(module)
                continue
            check_supported(tensor.name, tensor.tensor_type)  # before any layer loads
            k, n = (int(x) for x in tensor.shape.tolist())  # ggml order: innermost first
            self._tensors[module] = _Tensor(
                tensor.name, tensor.tensor_type, int(tensor.data_offset), int(tensor.n_bytes),
                n, k, heads.get(proj),
            )  # fmt: skip
        self.modules = fused_modules(self._tensors, floats)
        self.checkpoint_names = {f"model.{p}.weight" for p in self._tensors}

    def take(self, module: str) -> QuantizedWeight:
        """``module``'s weight, its parts read, decoded and fused."""
        return concat_rows([self._read(self._tensors[p]) for p in self.modules[module]])

    def _read(self, t: _Tensor) -> QuantizedWeight:
        raw = read_bytes(self.path, t.offset, t.nbytes, t.name)
        qw = tensor_to_qweight(t.name, t.qtype, raw, t.n, t.k)
        return qw if t.heads is None else _unpermute(qw, t.heads)


def read_output_weight(path: str | Path) -> tuple[QuantizedWeight, str] | None:
    """The LM head as the GGUF stores it, and its type's name: ``output.weight``, or
    ``token_embd.weight`` where the file ties the two (no ``output.weight``); None when that
    tensor is stored as floats or in a type kvserve has no quantized layer for."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if t is None or t.tensor_type not in SUPPORTED_TYPES:
        return None
    k, n = (int(x) for x in t.shape.tolist())  # ggml order: innermost first
    raw = read_bytes(Path(path), int(t.data_offset), int(t.n_bytes), t.name)
    return tensor_to_qweight(t.name, t.tensor_type, raw, n, k), t.tensor_type.name


def load_gguf_linears(path: str | Path, config: PretrainedConfig) -> dict[str, QuantizedWeight]:
    """Every quantized projection of a llama GGUF at once (``GGUFLinears.take`` of each):
    module path (``layers.3.self_attn.qkv_proj``) -> weight."""
    source = GGUFLinears(path, config)
    return {module: source.take(module) for module in source.modules}
