"""kvserve: an LLM serving engine with a paged KV cache, an OpenAI-compatible server and a
benchmark lab."""

import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from kvserve.worker.cpu_binding import WAIT_POLICY  # imports no torch

# libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it (the next import does):
# kvserve's default (measured in docs/performance.md, "OpenMP wait policy") unless the user
# set one, and only where torch is not loaded yet, so that the variable always says what
# libgomp uses. Worker processes get it at spawn (cpu_binding.worker_environment).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)

if TYPE_CHECKING:
    from kvserve.config import KVPolicy, PreemptionMode
    from kvserve.engine.llm import LLM
    from kvserve.lora.request import LoRARequest
    from kvserve.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from kvserve.pooling_params import PoolingParams
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured_output.params import StructuredOutputsParams

# The public names load on first use (PEP 562), not with the package: a process that needs
# only a part of kvserve (a grammar compile worker's zygote, a kernel check) would otherwise
# import the engine and transformers too (1.9 s of CPU in each server's zygote, measured
# `import kvserve.structured_output.compile_worker, xgrammar` against `import xgrammar`).
_LAZY = {
    "LLM": "kvserve.engine.llm",
    "CompletionOutput": "kvserve.outputs",
    "EmbeddingOutput": "kvserve.outputs",
    "EmbeddingRequestOutput": "kvserve.outputs",
    "KVPolicy": "kvserve.config",
    "LoRARequest": "kvserve.lora.request",
    "PoolingParams": "kvserve.pooling_params",
    "PreemptionMode": "kvserve.config",
    "RequestOutput": "kvserve.outputs",
    "SamplingParams": "kvserve.sampling_params",
    "ScoringOutput": "kvserve.outputs",
    "ScoringRequestOutput": "kvserve.outputs",
    "StructuredOutputsParams": "kvserve.structured_output.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "KVPolicy",
    "LoRARequest",
    "PoolingParams",
    "PreemptionMode",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def _configure_logging() -> None:
    """Show kvserve's INFO lines (model load, KV cache size) by default, as vLLM does.

    Set ``KVSERVE_CONFIGURE_LOGGING=0`` to leave logging entirely to the application.
    """
    logger = logging.getLogger("kvserve")
    if os.environ.get("KVSERVE_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the CLI's basicConfig would otherwise print each line twice


_configure_logging()
