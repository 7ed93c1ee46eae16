"""The model's default sampling values: vLLM's ``--generation-config auto``.

A checkpoint's ``generation_config.json`` may say how its authors meant it to be sampled
(Qwen3: temperature 0.6, top_k 20, top_p 0.95). vLLM makes those values the defaults of
every request that does not set the field itself (``ModelConfig.get_diff_sampling_param``):
``LLM.generate`` without sampling parameters, and the OpenAI endpoints for each field a
request leaves out. ``--generation-config vllm`` ignores the file (vLLM's neutral defaults).
The engine reads the file once (``sampling_defaults``) and owns the result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvserve.config import GenerationConfigSource
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

# generation_config.json key -> the SamplingParams field it is the default of: the keys of
# vLLM's get_diff_sampling_param; Hugging Face's max_new_tokens is vLLM's max_tokens.
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(
    model_path: Path, source: GenerationConfigSource, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> the model's default value (empty under ``vllm``, or when the
    file is missing or sets none). ``extra``: the model source's own defaults (Ollama's
    params layer), over the file's. Values ``SamplingParams`` would refuse raise a
    ``ValueError`` naming the file, at load, rather than failing every request later."""
    gen = model_path / "generation_config.json"
    if source is GenerationConfigSource.VLLM or (not gen.is_file() and not extra):
        return {}
    values = json.loads(gen.read_text(encoding="utf-8")) if gen.is_file() else {}
    if not isinstance(values, dict):
        raise ValueError(f"{gen} is not a JSON object")
    defaults = {f: values[k] for k, f in SAMPLING_KEYS.items() if values.get(k) is not None}
    defaults.update(extra or {})
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(
            f"{gen} sets default sampling values {defaults} that are not valid: {e} Fix the "
            f"file, or give --generation-config vllm to ignore it"
        ) from e
    if defaults:
        logger.info(
            "default sampling values from %s: %s (requests that set a field keep their own "
            "value; --generation-config vllm ignores the file)",
            gen, defaults,
        )  # fmt: skip
    return defaults
