"""Where each GGUF tensor goes in a Hugging Face folder: llama.cpp's names (gguf.constants'
``MODEL_TENSORS``) mapped to each native family's, with shapes checked (``plan_tensors``).

One GGUF tensor may become several HF tensors, each a run of its rows (``Planned.row_start``):
phi3's fused ``attn_qkv`` (q, k, v rows) and ``ffn_up`` (gate rows, then up rows), and the MoE
files' stacked experts ``ffn_{gate,up,down}_exps`` (``[E, rows, cols]``: expert e's rows are
the e-th run), written as the per-expert names Hub checkpoints use.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as _gguf_dequantize

from kvserve.model import held_headers
from kvserve.model.gguf_metadata import LlamaHParams, hf_architecture

logger = logging.getLogger(__name__)

_L = "model.layers.{i}."
# llama.cpp per-block tensor name -> Hugging Face Llama name (`{i}` layer, `{e}` expert).
BLOCK_TENSOR_MAP: dict[str, str] = {
    "attn_q": _L + "self_attn.q_proj.weight",
    "attn_k": _L + "self_attn.k_proj.weight",
    "attn_v": _L + "self_attn.v_proj.weight",
    "attn_output": _L + "self_attn.o_proj.weight",
    "ffn_gate": _L + "mlp.gate_proj.weight",
    "ffn_up": _L + "mlp.up_proj.weight",
    "ffn_down": _L + "mlp.down_proj.weight",
    "attn_norm": _L + "input_layernorm.weight",
    "ffn_norm": _L + "post_attention_layernorm.weight",
    "attn_q_norm": _L + "self_attn.q_norm.weight",
    "attn_k_norm": _L + "self_attn.k_norm.weight",
}
# Gemma 2/3's sandwich norms: llama.cpp's ffn_norm is the pre-MLP norm there.
_GEMMA23_MAP = {
    **BLOCK_TENSOR_MAP,
    "ffn_norm": _L + "pre_feedforward_layernorm.weight",
    "post_attention_norm": _L + "post_attention_layernorm.weight",
    "post_ffw_norm": _L + "post_feedforward_layernorm.weight",
}
_QWEN_MOE_MAP = {
    **BLOCK_TENSOR_MAP,
    "ffn_gate_inp": _L + "mlp.gate.weight",
    "ffn_gate_exps": _L + "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps": _L + "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps": _L + "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_inp_shexp": _L + "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": _L + "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp": _L + "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": _L + "mlp.shared_expert.down_proj.weight",
}
_MIXTRAL_MAP = {
    **BLOCK_TENSOR_MAP,
    "ffn_gate_inp": _L + "block_sparse_moe.gate.weight",
    "ffn_gate_exps": _L + "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps": _L + "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps": _L + "block_sparse_moe.experts.{e}.w2.weight",
}
# gpt-oss: sinks, biases on every projection and the router, a post-attention norm in place
# of ffn_norm; each stacked bias [E, rows] goes whole to FusedExperts (``*_proj_bias``)
_GPT_OSS_MAP = {
    **BLOCK_TENSOR_MAP,
    "post_attention_norm": _L + "post_attention_layernorm.weight",
    "attn_sinks": _L + "self_attn.sinks",
    "ffn_gate_inp": _L + "mlp.router.weight",
    "ffn_gate_exps": _L + "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps": _L + "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps": _L + "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_exps.bias": _L + "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": _L + "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": _L + "mlp.experts.down_proj_bias",
}
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm")
_LLAMA_KINDS = (*_ATTN, "ffn_gate", "ffn_up", "ffn_down")
_GEMMA2_KINDS = (*_LLAMA_KINDS, "post_attention_norm", "post_ffw_norm")
_QKV_BIAS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
_EXPERTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_GPT_OSS_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "post_attention_norm",
                  *_QKV_BIAS, "attn_output.bias", "attn_sinks", *_EXPERTS,
                  *(f"{k}.bias" for k in _EXPERTS))  # fmt: skip
# The per-block tensors each architecture has, all of them required (gguf.constants'
# MODEL_TENSORS less the optional rope_freqs / rope_factors: read_hparams turns a llama
# file's rope_freqs into Llama 3's rope scaling and refuses the others).
_ARCH_BLOCK_KINDS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_KINDS,
    "qwen2": (*_LLAMA_KINDS, *_QKV_BIAS),
    "qwen3": (*_LLAMA_KINDS, "attn_q_norm", "attn_k_norm"),
    "gemma": _LLAMA_KINDS,
    "gemma2": _GEMMA2_KINDS,
    "gemma3": (*_GEMMA2_KINDS, "attn_q_norm", "attn_k_norm"),
    "phi3": ("attn_qkv", "attn_output", "ffn_up", "ffn_down", "attn_norm", "ffn_norm"),
    "qwen2moe": (*_ATTN, *_QKV_BIAS, *_EXPERTS, *_SHARED),
    "qwen3moe": (*_ATTN, "attn_q_norm", "attn_k_norm", *_EXPERTS),
    "olmoe": (*_ATTN, "attn_q_norm", "attn_k_norm", *_EXPERTS),
    "llama+experts": (*_ATTN, *_EXPERTS),  # Mixtral: a llama file with llama.expert_count
    "gpt-oss": _GPT_OSS_KINDS,
}
_PHI3_FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}
GLOBAL_TENSOR_MAP: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# A vision tower and its projector packed into the model's file (Ollama's gemma3 files:
# `v.blk.*`, `v.patch_embd`, `mm.mm_input_projection`; llama.cpp keeps them in an mmproj file).
VISION_PREFIXES = ("v.", "mm.")
BLOCK_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's split files (convert_hf_to_gguf.py --split-max-*, gguf-split): name-00001-of-00003
_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_names(name: str) -> list[str]:
    """The file names of the split model file ``name`` is a shard of, in order; ``[name]``
    when it is not a shard."""
    m = _SHARD_RE.match(name)
    if m is None:
        return [name]
    count = int(m["count"])
    return [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def shard_paths(path: Path) -> list[Path]:
    """Every file of the model ``path`` is (any shard of) in order; ``[path]`` if unsplit."""
    paths = [path.with_name(name) for name in shard_names(path.name)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path.name} is one of {len(paths)} GGUF shards; missing: {missing}"
        )
    return paths


class HeaderReader(GGUFReader):
    """gguf's ``GGUFReader``, each of its reads a slice of a plain ndarray view of the file's
    map instead of the ``np.memmap`` itself: the header's fields and tensors are the same
    (``tests/model/test_gguf_names.py`` compares them), but the memmap subclass's per-slice
    overhead was most of the parse, which reads every vocabulary string one by one:
    Qwen3-0.6B's 151,936 tokens 4.8 -> 1.5 s, on every load of such a file."""

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:  # fmt: skip
        plain = self.__dict__.get("_plain")
        if plain is None:  # the map's bytes, no memmap subclass
            plain = self._plain = self.data.view(np.ndarray)
        dt, count = np.dtype(dtype), int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


class GGUFFiles:
    """A GGUF model in one file or split into shards, read as one: the first file's metadata
    (llama.cpp writes it there only), every file's tensors, and which file holds each."""

    def __init__(self, path: str | Path) -> None:
        self.paths = shard_paths(Path(path))
        readers = [HeaderReader(str(p)) for p in self.paths]
        self.fields = readers[0].fields
        count = self.fields.get("split.count")
        if count is not None and int(count.contents()) != len(self.paths):
            raise ValueError(f"{self.paths[0].name} says split.count {count.contents()}, "
                             f"found {len(self.paths)} files")  # fmt: skip
        self.tensors = [t for r in readers for t in r.tensors]
        self.path_of = {t.name: p for r, p in zip(readers, self.paths, strict=True)
                        for t in r.tensors}  # fmt: skip


def open_gguf(path: str | Path) -> GGUFFiles:
    """``GGUFFiles(path)``, the one already parsed inside ``held_headers.headers_held`` if the
    file (its first shard: path, size, mtime) is unchanged."""
    files = held_headers.held()
    if files is None:
        return GGUFFiles(path)
    resolved = Path(path).resolve()
    st = resolved.stat()
    key = (str(resolved), st.st_size, st.st_mtime_ns)
    if key not in files:
        files[key] = GGUFFiles(resolved)
    return files[key]


def _family(hp: LlamaHParams) -> str:
    """The key of ``_ARCH_BLOCK_KINDS`` for ``hp``."""
    if hp.architecture == "llama" and hf_architecture(hp) == "MixtralForCausalLM":
        return "llama+experts"
    return hp.architecture


def _names(hp: LlamaHParams) -> dict[str, str]:
    family = _family(hp)
    if family in ("gemma2", "gemma3"):
        return _GEMMA23_MAP
    if family in ("qwen2moe", "qwen3moe", "olmoe"):
        return _QWEN_MOE_MAP
    if family == "gpt-oss":
        return _GPT_OSS_MAP
    return _MIXTRAL_MAP if family == "llama+experts" else BLOCK_TENSOR_MAP


def block_hf_name(hp: LlamaHParams, kind: str, layer: int, expert: int = 0) -> str:
    """HF name of block tensor ``kind`` (``attn_q``, ``attn_q.bias``, ...) of ``layer``."""
    names = _names(hp)
    if kind.endswith(".bias") and kind not in names:  # else a name of its own (gpt-oss's
        weight = names[kind.removesuffix(".bias")].format(i=layer)  # stacked expert biases)
        return weight.removesuffix("weight") + "bias"
    return names[kind].format(i=layer, e=expert)


def moe_sizes(hp: LlamaHParams) -> tuple[int, int, int]:
    """(experts, an expert's intermediate size, the shared expert's); zeros for dense models."""
    e = hp.extra
    experts = int(e.get("num_experts") or e.get("num_local_experts") or 0)
    inter = int(e.get("moe_intermediate_size") or hp.intermediate_size)
    return experts, inter, int(e.get("shared_expert_intermediate_size") or 0)


def expected_shapes(hp: LlamaHParams) -> dict[str, tuple[int, ...]]:
    """HF [out, in] shape of every tensor kind (an expert's for the ``_exps`` kinds), keyed by
    llama.cpp kind / global name."""
    h, q_rows = hp.hidden_size, hp.num_attention_heads * hp.head_dim
    kv_rows = hp.num_key_value_heads * hp.head_dim
    experts, inter, shared = moe_sizes(hp)
    # q/k norm weights: one head's (qwen3, gemma3), or the whole projection's (olmoe)
    q_norm, k_norm = (q_rows, kv_rows) if hp.architecture == "olmoe" else (hp.head_dim,) * 2
    return {
        "attn_q": (q_rows, h), "attn_k": (kv_rows, h), "attn_v": (kv_rows, h),
        "attn_output": (h, q_rows),
        "ffn_gate": (hp.intermediate_size, h), "ffn_up": (hp.intermediate_size, h),
        "ffn_down": (h, hp.intermediate_size),
        "attn_norm": (h,), "ffn_norm": (h,), "post_attention_norm": (h,), "post_ffw_norm": (h,),
        "attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
        "attn_output.bias": (h,), "attn_sinks": (hp.num_attention_heads,),
        "ffn_gate_inp.bias": (experts,), "ffn_gate_exps.bias": (experts, inter),
        "ffn_up_exps.bias": (experts, inter), "ffn_down_exps.bias": (experts, h),
        "attn_q_norm": (q_norm,), "attn_k_norm": (k_norm,),
        "ffn_gate_inp": (experts, h),
        "ffn_gate_exps": (inter, h), "ffn_up_exps": (inter, h), "ffn_down_exps": (h, inter),
        "ffn_gate_inp_shexp": (1, h),
        "ffn_gate_shexp": (shared, h), "ffn_up_shexp": (shared, h), "ffn_down_shexp": (h, shared),
        "token_embd.weight": (hp.vocab_size, h), "output.weight": (hp.vocab_size, h),
        "output_norm.weight": (h,),
    }  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """One Hugging Face tensor's source in the GGUF: a whole tensor, or a run of its rows."""

    tensor: ReaderTensor
    kind: str  # llama.cpp kind (attn_q, ...) or global name (token_embd.weight, ...)
    hf_name: str
    shape: tuple[int, ...]  # HF [out, in] (or [n] for norms)
    row_start: int = 0  # first row of ``tensor`` it takes (fused phi3 parts, experts)
    path: Path = Path()  # the file (shard) holding ``tensor``


@functools.cache
def dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether the installed ``gguf`` package dequantizes ``qtype`` (tried on one zero block)."""
    try:
        _gguf_dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_dequantizable(tensor: ReaderTensor) -> None:
    """Refuse, by name, a tensor type ``gguf`` cannot dequantize (before anything is written)."""
    if not dequantizable(tensor.tensor_type):
        from importlib.metadata import version

        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which kvserve "
            f"cannot load (the gguf package {version('gguf')} has no dequantizer for it)"
        )


def _parts(hp: LlamaHParams, kind: str, shapes: dict) -> list[tuple[str, int, tuple[int, ...]]]:
    """The HF tensors GGUF tensor ``kind`` holds, in row order: (kind, expert, shape)."""
    if kind.endswith("_exps"):  # each expert a run of rows (a stacked bias goes whole)
        return [(kind, e, shapes[kind]) for e in range(moe_sizes(hp)[0])]
    if hp.architecture == "phi3" and kind in _PHI3_FUSED:
        return [(p, 0, shapes[p]) for p in _PHI3_FUSED[kind]]
    return [(kind, 0, shapes[kind])]


def plan_block(
    tensor: ReaderTensor, hp: LlamaHParams, shapes: dict, path: Path = Path()
) -> list[Planned]:
    """The HF tensors block tensor ``tensor`` becomes (several for fused ones and experts)."""
    name = tensor.name
    match = BLOCK_NAME_RE.match(name)
    kind = "" if match is None else match[2] + (".bias" if match[3] == "bias" else "")
    if match is None or kind not in _ARCH_BLOCK_KINDS[_family(hp)]:
        raise ValueError(f"unexpected tensor {name!r} in a {hp.architecture} GGUF")
    layer = int(match[1])
    if layer >= hp.num_hidden_layers:
        raise ValueError(f"unexpected tensor {name!r} in a {hp.architecture} GGUF")
    parts = _parts(hp, kind, shapes)
    # GGUF stores ggml `ne` order (innermost first), i.e. reversed numpy/HF order; stacked
    # experts [E, rows, cols] are checked as [E * rows, cols]
    got = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    got = (int(np.prod(got[:-1])), got[-1]) if len(got) == 3 else got
    want = (sum(s[0] for _, _, s in parts), *parts[0][2][1:])
    if got != want and not (len(want) == 2 and want[0] == 1 and got == want[1:]):
        raise ValueError(f"tensor {name!r} has shape {got}, expected {want}")
    plan, start = [], 0
    for part, expert, shape in parts:
        name = block_hf_name(hp, part, layer, expert)
        plan.append(Planned(tensor, part, name, shape, start, path))
        start += shape[0]
    return plan


def expected_hf_names(hp: LlamaHParams) -> set[str]:
    """Every HF tensor a complete file of ``hp`` gives."""
    shapes = expected_shapes(hp)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not hp.tie_word_embeddings:
        names.add("lm_head.weight")
    for kind in _ARCH_BLOCK_KINDS[_family(hp)]:
        for part, expert, _ in _parts(hp, kind, shapes):
            names |= {block_hf_name(hp, part, i, expert) for i in range(hp.num_hidden_layers)}
    return names


def plan_tensors(reader: GGUFFiles, hp: LlamaHParams) -> list[Planned]:
    """Name and shape of every tensor in HF terms, checked before any is converted."""
    shapes = expected_shapes(hp)
    plan = []
    vision = [t.name for t in reader.tensors if t.name.startswith(VISION_PREFIXES)]
    if vision:
        logger.info("%d vision tensors (%s, ...) not loaded: kvserve serves the text model",
                    len(vision), vision[0])  # fmt: skip
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith(VISION_PREFIXES):
            continue
        _check_dequantizable(tensor)
        path = reader.path_of[name]
        if name.startswith("blk."):
            plan += plan_block(tensor, hp, shapes, path)
            continue
        if name == "rope_freqs.weight":  # in config.json as Llama 3's rope scaling (gguf_rope)
            continue
        if name not in GLOBAL_TENSOR_MAP:
            # Refuse rather than drop: an unknown tensor means the model is not what the
            # config says, and a silently incomplete conversion would be wrong.
            raise ValueError(f"unexpected tensor {name!r} in a {hp.architecture} GGUF")
        got = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if got != shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {got}, expected {shapes[name]}")
        plan.append(Planned(tensor, name, GLOBAL_TENSOR_MAP[name], got, 0, path))
    missing = expected_hf_names(hp) - {p.hf_name for p in plan}
    if missing:
        raise ValueError(f"GGUF is missing tensors: {sorted(missing)[:5]} ...")
    return plan
