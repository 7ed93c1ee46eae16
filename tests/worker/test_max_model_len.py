"""``max_model_len`` above the model's own limit is refused as vLLM does, unless vLLM's
VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; at or below it, it is the context limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from kvserve import LLM
from kvserve.config import ModelConfig
from kvserve.worker.model_setup import resolve_max_model_len
from tests.model.hub_stand_in import make_tiny_repo

HF = LlamaConfig(max_position_embeddings=512)


def test_max_model_len_within_the_models_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert resolve_max_model_len(ModelConfig(path="m"), HF) == 512
    assert resolve_max_model_len(ModelConfig(path="m", max_model_len=100), HF) == 100
    assert resolve_max_model_len(ModelConfig(path="m", max_model_len=512), HF) == 512


def test_max_model_len_above_the_models_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError) as e:
        resolve_max_model_len(ModelConfig(path="m", max_model_len=2048), HF)
    assert str(e.value) == (
        "max_model_len 2048 (--max-model-len) is greater than the model's own limit 512 "
        "(max_position_embeddings in its config.json); set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to "
        "allow it anyway (the model may give garbage past 512 tokens)"
    )
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert resolve_max_model_len(ModelConfig(path="m", max_model_len=2048), HF) == 2048


def test_llm_refuses_it_before_loading_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    folder = make_tiny_repo(tmp_path / "tiny")
    (folder / "model.safetensors").unlink()  # never read: the refusal comes first
    with pytest.raises(
        ValueError,
        match=r"^max_model_len 4096 \(--max-model-len\) is greater "
        r"than the model's own limit 512",
    ):
        LLM(str(folder), max_model_len=4096, dtype="float32")
