"""The in-process executor: the engine's default; the engine sets torch's thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.config import ParallelConfig
from kvserve.executor.uniproc import UniProcExecutor


def test_the_engine_sets_the_thread_count(tiny_llama: Path) -> None:
    before = torch.get_num_threads()
    want = 2 if before != 2 else 1
    try:
        llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, num_threads=want)
        assert torch.get_num_threads() == want
        assert isinstance(llm.engine.executor, UniProcExecutor)
        assert llm.engine.runner is llm.engine.executor.runner
        assert llm.engine.kv.pool.num_blocks == llm.engine.runner.num_blocks == 16
    finally:
        torch.set_num_threads(before)


def test_parallel_config_names_and_refusals() -> None:
    assert ParallelConfig().distributed_executor_backend.value == "uni"  # type: ignore[union-attr]
    assert ParallelConfig(2).distributed_executor_backend.value == "mp"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="needs 'mp'"):
        ParallelConfig(2, "uni")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be one of \['uni', 'mp'\], got 'ray'"):
        ParallelConfig(1, "ray")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        ParallelConfig(0)
