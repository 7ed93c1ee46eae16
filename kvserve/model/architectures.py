"""Architecture names and the refusals that need no model class: light, so that importing
kvserve (every server, rank and CLI start) does not import transformers' modeling code.

``transformers_backend.py`` imports ``PreTrainedModel`` and the attention interface, which pull
in torch.distributed.tensor, dynamo and the fp8 integrations: about 3 s of CPU per process on
the 2-core test machine (``python -X importtime -c 'import kvserve'``, 8.0 s user before this
split). The registry and the loader import that module only when a model runs on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["REMOTE_CODE", "architecture_name", "backend_refusal", "remote_code_error"]

REMOTE_CODE = (
    "its config has an auto_map (trust_remote_code model); kvserve never runs a model's own "
    "Python code"
)


def architecture_name(config: PretrainedConfig) -> str:
    """The config's first architecture, or the causal-LM class transformers maps its type to."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return str(archs[0])
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)


def backend_refusal(arch: str, reason: str) -> ValueError:
    """The error of an architecture the transformers backend cannot run."""
    return ValueError(f"cannot run {arch} through the transformers backend: {reason}")


def remote_code_error(path: Path) -> ValueError | None:
    """A clear refusal for a folder whose config.json asks for remote code, else None."""
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not raw.get("auto_map"):
        return None
    arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
    return backend_refusal(arch, REMOTE_CODE)
