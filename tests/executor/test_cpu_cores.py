"""``--cpu-cores`` through the engine: each worker process reads back, in its own process,
exactly the cores it was given (its mask, one OpenMP thread per core, torch's count)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def engine(path: Path, cores: str, tp: int) -> LLMEngine:
    return LLMEngine(build_engine_config(
        str(path), dtype="float32", block_size=4, num_kv_blocks=16, tensor_parallel_size=tp,
        distributed_executor_backend="mp", cpu_cores=cores,
    ))  # fmt: skip


def tokens(e: LLMEngine) -> list[int]:
    e.add_request("0", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


def test_a_worker_runs_on_the_one_core_it_was_given(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    e = engine(tiny_llama, "1", 1)
    try:
        paths = e.execution_paths
        assert (paths.cpu_affinity, paths.num_threads, paths.thread_cores) == ((1,), 1, ((1,),))
        # the worker was spawned with kvserve's wait policy; the driver's environment is back
        assert paths.omp_wait_policy == "PASSIVE" and "OMP_WAIT_POLICY" not in os.environ
        assert (paths.dtype, paths.weight_dtype) == ("float32", "float32")
        assert len(tokens(e)) == 4
    finally:
        e.close()
    assert os.sched_getaffinity(0) != {1}  # the engine's own process was left alone


def test_each_tensor_parallel_rank_reports_its_own_core(tiny_llama: Path) -> None:
    e = engine(tiny_llama, "0|1", 2)
    try:
        ranks = [(p.cpu_affinity, p.num_threads, p.thread_cores) for p in e.rank_execution_paths]
        assert ranks == [((0,), 1, ((0,),)), ((1,), 1, ((1,),))]
        assert len(tokens(e)) == 4
    finally:
        e.close()
