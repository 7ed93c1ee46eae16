"""Fixtures for engine tests: tiny random models of each supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.engine.utils import make_tiny_model

TinyModels = dict[str, tuple[Path, PreTrainedModel]]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    out = {}
    for arch in ("llama", "qwen2", "mistral"):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, make_tiny_model(arch, path))
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: TinyModels) -> Path:
    return tiny_models["llama"][0]
