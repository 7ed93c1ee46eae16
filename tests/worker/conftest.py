"""The engine tests' tiny models."""

from tests.engine.conftest import tiny_llama, tiny_models

__all__ = ["tiny_llama", "tiny_models"]
