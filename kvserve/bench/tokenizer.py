"""Find and load the tokenizer the benchmark counts tokens with.

Prompt lengths of the datasets and the output-token fallback (when a server sends no ``usage``)
depend on it, so it must be the served model's tokenizer. Resolution order:

1. ``--tokenizer PATH`` when given;
2. ``--model`` when it is a local folder;
3. kvserve's built-in model when ``--model`` is absent or is its name
   (``SmolLM2-135M-Instruct``), or the converted folder of a ``--model`` GGUF file;
4. ``--model`` as a Hugging Face id (works only if it is already in the local HF cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def kvserve_model_folder(model: str | None) -> str | None:
    """The HF folder kvserve itself would load for ``model``: the built-in model for None or
    its name, the converted cache folder for a ``.gguf`` file; None when it does not apply or
    kvserve's model package is unavailable."""
    try:
        # Imported lazily: the model package is heavy and only needed for these cases.
        from kvserve.model.builtin import BUILTIN_MODEL_NAME, resolve_model
    except ImportError:
        return None
    if model is not None and model != BUILTIN_MODEL_NAME and not model.endswith(".gguf"):
        return None
    try:
        return str(resolve_model(None if model == BUILTIN_MODEL_NAME else model)[0])
    except (RuntimeError, ValueError, OSError):  # not installed / not a file: caller reports
        return None


def resolve_tokenizer_path(tokenizer: str | None, model: str | None) -> str:
    """Apply the resolution order of this module's docstring; raise ValueError if none fits."""
    if tokenizer:
        return tokenizer
    if model and Path(model).is_dir():
        return model
    folder = kvserve_model_folder(model)
    if folder is not None:
        return folder
    if model:
        return model
    raise ValueError(
        "cannot tell which tokenizer to use: the built-in model is not installed; pass "
        "--tokenizer PATH (a local folder with tokenizer files) or --model with a local folder."
    )


def load_tokenizer(tokenizer: str | None, model: str | None) -> PreTrainedTokenizerBase:
    """Load the resolved tokenizer with ``transformers.AutoTokenizer``."""
    from transformers import AutoTokenizer

    path = resolve_tokenizer_path(tokenizer, model)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({e}); pass --tokenizer with a local "
            "folder holding the served model's tokenizer files."
        ) from e
