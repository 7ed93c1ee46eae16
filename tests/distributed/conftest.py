"""Fixtures for tensor-parallel tests: tiny random models of each Llama-family architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.utils import make_tiny_model


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama / Qwen2 (q/k/v bias, tied embeddings) / Mistral folders: 4 query heads,
    2 K/V heads, so each of 2 ranks holds 2 query heads and 1 K/V head."""
    out = {}
    for arch in ("llama", "qwen2", "mistral"):
        path = tmp_path_factory.mktemp(f"tp-{arch}")
        make_tiny_model(arch, path)
        out[arch] = path
    return out
