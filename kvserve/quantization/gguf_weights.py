"""GGUF quantized tensors as ``QuantizedWeight``s, without going through a float weight.

Each GGUF block type kvserve keeps quantized maps exactly onto codes plus a scale (and zero)
per group, computed the way ``gguf.quants.dequantize`` computes it (``gguf_blocks``: the table
of types; tests check the values are identical).

llama.cpp stores ``attn_q``/``attn_k`` rows of ``llama`` files in its rotary order; rows are
unpermuted as the float converter does (``gguf_convert.unpermute_rotary``), codes and scales
alike. the other architectures keep HF's row order (llama.cpp does not permute them).

``GGUFLinears`` decodes one fused module at a time (``take``), reading its tensors with plain
reads: the loader builds each quantized layer as its turn comes, so neither the whole set of
decoded weights nor the file's pages (a memory map's touched pages count in the process's RSS
until it is unmapped) are ever held at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import PretrainedConfig

from kvserve.model.gguf_convert import read_bytes, unpermute_rotary
from kvserve.model.gguf_metadata import LlamaHParams, read_architecture
from kvserve.model.gguf_names import GGUFFiles, expected_shapes, open_gguf, plan_block
from kvserve.quantization.fusion import FUSED, fused_modules
from kvserve.quantization.gguf_blocks import LAYOUTS, SUPPORTED_TYPES, decode_blocks
from kvserve.quantization.qweight import QuantizedWeight, SuperScales, concat_rows

T = GGMLQuantizationType
logger = logging.getLogger(__name__)


def check_supported(name: str, qtype: T) -> None:
    """Refuse, by name, a GGUF tensor type that has no quantized layer in kvserve."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has type {qtype.name}, which --quantization gguf cannot keep "
            f"quantized; supported: {[t.name for t in SUPPORTED_TYPES]} (or load the file "
            "without --quantization: it is then dequantized)"
        )


# Rows decoded at a time: decode_blocks' numpy temporaries are several bytes per weight, so
# whole they were the load's peak. Qwen3-0.6B's tied Q6_K LM head (151,936 x 1024; 194 MB
# kept) peaked 1311 MB above the start decoded whole; TinyLlama-1.1B's (32,000 x 2048) 515.
DECODE_ROWS = 2048


def tensor_to_qweight(name: str, qtype: T, raw: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor of ``n`` rows of ``k`` values as a ``QuantizedWeight`` (with its
    two-level ``SuperScales`` for the K-quants), decoded DECODE_ROWS rows at a time."""
    check_supported(name, qtype)
    g, bits = LAYOUTS[qtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, -1)  # a row's blocks are contiguous
    widths = (k, k // g, k // g, k // 256, k // g, k // 256, k // g)  # codes .. m
    out: list[torch.Tensor | None] = []
    for r in range(0, n, DECODE_ROWS):
        codes, scales, zeros, two = decode_blocks(blocks[r : r + DECODE_ROWS].reshape(-1), qtype)
        fields = (codes, scales, zeros, *(two if two is not None else (None,) * 4))
        if not out:  # the whole tensor's fields, shaped and typed after the first rows'
            out = [None if f is None else torch.empty(n, w, dtype=torch.from_numpy(f).dtype)
                   for f, w in zip(fields, widths, strict=True)]  # fmt: skip
        for t, f in zip(out, fields, strict=True):
            if t is not None and f is not None:
                chunk = t[r : r + DECODE_ROWS]
                chunk.copy_(torch.from_numpy(np.ascontiguousarray(f)).reshape(chunk.shape))
    codes_t, scale_t, zeros_t, d, sc, dmin, m = out
    assert codes_t is not None and scale_t is not None
    supers = None if d is None or sc is None else SuperScales(d, sc, dmin, m)
    return QuantizedWeight(codes=codes_t, scales=scale_t, zeros=zeros_t, bits=bits,
                           group_size=g, supers=supers)  # fmt: skip


def _unpermute(qw: QuantizedWeight, heads: int) -> QuantizedWeight:
    z = None if qw.zeros is None else unpermute_rotary(qw.zeros, heads).contiguous()
    supers = None
    if qw.supers is not None:  # the same row order for every per-row field
        order = unpermute_rotary(torch.arange(qw.shape[0]).unsqueeze(1), heads).squeeze(1)
        supers = qw.supers.rows(order)
    return QuantizedWeight(
        unpermute_rotary(qw.codes, heads).contiguous(),
        unpermute_rotary(qw.scales, heads).contiguous(),
        z, qw.bits, qw.group_size, supers=supers,
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
    path: Path  # the file (shard) holding it


def _config_hparams(config: PretrainedConfig, arch: str) -> LlamaHParams:
    """The sizes the projections must have, from the model's config (the file may carry only
    weights) and the file's architecture (which says how its tensors are named and fused)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return LlamaHParams(
        vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_hidden_layers=int(config.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim), max_position_embeddings=0, rms_norm_eps=0.0, rope_theta=0.0,
        rope_scaling=None, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, architecture=arch, extra=_moe_extra(config, arch),
    )  # fmt: skip


def _moe_extra(config: PretrainedConfig, arch: str) -> dict[str, int]:
    """The expert sizes ``gguf_names`` plans stacked expert tensors with (none: dense)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return {}
    if arch == "llama":  # Mixtral: experts of intermediate_size
        return {"num_local_experts": int(experts)}
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    # OLMoE's experts are of intermediate_size (it has no moe_intermediate_size)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return {"num_experts": int(experts), "moe_intermediate_size": int(inter),
            "shared_expert_intermediate_size": int(shared)}  # fmt: skip


_EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def _fused_name(module: str) -> str:
    """``layers.3.self_attn.q_proj`` -> the kvserve module it is part of (``...qkv_proj``)."""
    prefix, proj = module.rsplit(".", 1)
    return f"{prefix}.{FUSED[proj][0]}"


class GGUFLinears:
    """The decoder layers' quantized projections of a GGUF, fused as kvserve's model fuses them.
    ``modules``: kvserve module path (``layers.3.self_attn.qkv_proj``) -> its parts;
    ``checkpoint_names``: the converted folder's tensors they stand for
    (``model.layers.3.self_attn.q_proj.weight``, and each expert's matrices of the MoE layers
    in ``experts``), which the loader need not read.

    A fused module any part of which is stored as floats (F32/F16/BF16) or in a type with no
    quantized layer (``dense_types``: the IQ1/IQ2/IQ3 grids, TQ1_0, TQ2_0, ...) is left
    out: it stays an ordinary layer of the serving dtype, its weights the converted folder's
    (gguf's dequantizer's values). phi3's fused q/k/v and gate/up are read a run of rows each
    (``gguf_names.plan_block``)."""

    def __init__(self, path: str | Path, config: PretrainedConfig) -> None:
        self.path = Path(path)
        reader = open_gguf(path)  # the headers only (every shard's): data is read in take()
        hp = _config_hparams(config, read_architecture(reader))
        heads = {"attn_q": hp.num_attention_heads, "attn_k": hp.num_key_value_heads}
        if hp.architecture != "llama":
            heads = {}  # only llama files have permuted q/k rows
        shapes = expected_shapes(hp)
        parts: dict[str, _Tensor] = {}  # by projection (layers.3.self_attn.q_proj)
        dense: dict[str, str] = {}  # fused module -> a type that keeps it dense
        planned = [p for t in reader.tensors if t.name.startswith("blk.")
                   for p in plan_block(t, hp, shapes, reader.path_of[t.name])]  # fmt: skip
        experts: dict[str, dict[tuple[int, str], _Tensor]] = {}  # layers.3.mlp.experts -> parts
        expert_names: dict[str, set[str]] = {}  # layers.3.mlp.experts -> its folder names
        for p in planned:
            module = p.hf_name.removeprefix("model.").removesuffix(".weight")
            is_expert = p.kind in _EXPERT_PARTS
            if not module.endswith("_proj") and not is_expert:
                continue  # norms, biases, embeddings, routers
            qtype, n, k = p.tensor.tensor_type, p.shape[0], p.shape[1]
            if is_expert:
                layer = int(p.tensor.name.split(".")[1])  # blk.3.ffn_gate_exps.weight
                module = f"layers.{layer}.mlp.experts"
            if qtype not in SUPPORTED_TYPES:
                dense[module if is_expert else _fused_name(module)] = qtype.name
                continue
            # a run of the stored rows: phi3's fused parts, one expert of a stacked tensor
            row_bytes = int(p.tensor.n_bytes) // (int(np.prod(p.tensor.shape.tolist()[1:])))
            t = _Tensor(
                p.tensor.name, qtype, int(p.tensor.data_offset) + p.row_start * row_bytes,
                n * row_bytes, n, k, heads.get(p.kind), p.path,
            )  # fmt: skip
            if is_expert:
                experts.setdefault(module, {})[(p.row_start // n, _EXPERT_PARTS[p.kind])] = t
                expert_names.setdefault(module, set()).add(p.hf_name)
            else:
                parts[module] = t
        # each MoE layer's experts, all kept quantized (a layer with a dense part stays dense)
        self.experts = {m: e for m, e in experts.items() if m not in dense}
        self.dense_types = {name for name in dense.values() if name not in ("F32", "F16", "BF16")}
        if self.dense_types:
            logger.info("GGUF projections of types %s have no quantized layer in kvserve: %d "
                        "modules stay dense (dequantized)", sorted(self.dense_types),
                        len([m for m, t in dense.items() if t in self.dense_types]))  # fmt: skip
        self._tensors = {m: t for m, t in parts.items() if _fused_name(m) not in dense}
        self.modules = fused_modules(self._tensors)
        # the experts kept in the file's blocks are not read densely either: dequantizing the
        # OLMoE-1B-7B shape's 3072 expert matrices to float32 took most of a 390 s load
        self.checkpoint_names = {f"model.{p}.weight" for p in self._tensors} | {
            name for module in self.experts for name in expert_names[module]
        }

    def take(self, module: str) -> QuantizedWeight:
        """``module``'s weight, its parts read, decoded and fused."""
        return concat_rows([self._read(self._tensors[p]) for p in self.modules[module]])

    def take_expert(self, module: str, expert: int, proj: str) -> QuantizedWeight:
        """Expert ``expert`` of MoE layer ``module`` (``layers.3.mlp.experts``): its
        ``gate_up_proj`` (gate rows, then up rows) or ``down_proj``."""
        names = ("gate", "up") if proj == "gate_up_proj" else ("down",)
        parts = self.experts[module]
        return concat_rows([self._read(parts[(expert, n)]) for n in names])

    def _read(self, t: _Tensor) -> QuantizedWeight:
        raw = read_bytes(t.path, t.offset, t.nbytes, t.name)
        qw = tensor_to_qweight(t.name, t.qtype, raw, t.n, t.k)
        return qw if t.heads is None else _unpermute(qw, t.heads)


def _output_tensor(files: GGUFFiles) -> Any:
    """The LM head's tensor: ``output.weight``, or ``token_embd.weight`` where the file ties
    the two (no ``output.weight``); None when it is stored as floats or in a type kvserve has
    no quantized layer for."""
    tensors = {t.name: t for t in files.tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    return None if t is None or t.tensor_type not in SUPPORTED_TYPES else t


def output_tensor_kept(path: str | Path) -> bool:
    """Whether the GGUF has an untied ``output.weight`` of a type kvserve keeps quantized."""
    t = _output_tensor(open_gguf(path))
    return t is not None and t.name == "output.weight"


def read_output_weight(path: str | Path) -> tuple[QuantizedWeight, str] | None:
    """The LM head as the GGUF stores it (``_output_tensor``), and its type's name; None when
    that tensor is stored as floats or in a type kvserve has no quantized layer for."""
    files = open_gguf(path)
    t = _output_tensor(files)
    if t is None:
        return None
    k, n = (int(x) for x in t.shape.tolist())  # ggml order: innermost first
    raw = read_bytes(files.path_of[t.name], int(t.data_offset), int(t.n_bytes), t.name)
    return tensor_to_qweight(t.name, t.tensor_type, raw, n, k), t.tensor_type.name


def load_gguf_linears(path: str | Path, config: PretrainedConfig) -> dict[str, QuantizedWeight]:
    """Every quantized projection of a llama GGUF at once (``GGUFLinears.take`` of each):
    module path (``layers.3.self_attn.qkv_proj``) -> weight."""
    source = GGUFLinears(path, config)
    return {module: source.take(module) for module in source.modules}
