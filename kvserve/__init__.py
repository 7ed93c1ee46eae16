"""kvserve: an LLM serving engine with a paged KV cache, an OpenAI-compatible server and a
benchmark lab."""

import logging
import os
import sys

from kvserve.worker.cpu_binding import WAIT_POLICY  # imports no torch

# libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it (the next import does):
# kvserve's default (measured in docs/performance.md, "OpenMP wait policy") unless the user
# set one, and only where torch is not loaded yet, so that the variable always says what
# libgomp uses. Worker processes get it at spawn (cpu_binding.worker_environment).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)

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
