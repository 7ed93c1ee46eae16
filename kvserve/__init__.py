"""kvserve: an LLM serving engine with a paged KV cache, an OpenAI-compatible server and a
benchmark lab."""

from kvserve.config import KVPolicy, PreemptionMode
from kvserve.engine.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "KVPolicy",
    "PreemptionMode",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
