"""The engine tests' tiny models; the server tests' tiny model with a real tokenizer."""

from tests.engine.conftest import tiny_llama, tiny_models
from tests.server.conftest import tiny_model_dir

__all__ = ["tiny_llama", "tiny_model_dir", "tiny_models"]
