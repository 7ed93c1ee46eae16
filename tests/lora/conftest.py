"""Fixtures for LoRA tests: a tiny random Llama and four PEFT adapters over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.utils import make_tiny_model
from tests.lora.utils import SPECS, make_adapter


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora_base")
    make_tiny_model("llama", path)
    return path


@pytest.fixture(scope="session")
def adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(lora_base, root / name, spec, seed=i + 1)
        for i, (name, spec) in enumerate(SPECS.items())
    }
