"""The runner in worker processes (``distributed_executor_backend="mp"``) gives the tokens the
in-process runner gives (greedy and seeded, under preemption and prefix caching, KV integrity
checked in the driver after every step); a killed worker is a clear error, never a hang."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvserve.config import ExecutorBackend, ParallelConfig
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.executor import WorkerDiedError
from kvserve.executor.multiproc import MultiprocExecutor
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import random_prompts

SHARED = random_prompts([12], seed=5)[0]  # a shared 3-block prefix: prefix-cache hits
PROMPTS = [SHARED + p for p in random_prompts([3, 9, 5, 14], seed=6)] + random_prompts([7, 2])
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=17, max_tokens=20, ignore_eos=True),
]


def config(path: Path, **kw: Any) -> Any:
    kw.setdefault("num_kv_blocks", 24)  # too small for the batch: preemption
    return build_engine_config(str(path), dtype="float32", block_size=4, **kw)


def run(e: LLMEngine) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), {"prompt_token_ids": p}, PARAMS[i % 2])
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        e.kv.check_integrity()
    return done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_worker_process_equals_in_process(tiny_llama: Path, mode: str) -> None:
    uni = LLMEngine(config(tiny_llama, preemption_mode=mode))
    expected = run(uni)
    s = uni.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0  # both were exercised
    e = LLMEngine(config(tiny_llama, preemption_mode=mode, distributed_executor_backend="mp"))
    try:
        assert isinstance(e.executor, MultiprocExecutor) and e.runner is None
        assert e.kv.pool.num_blocks == 24
        assert run(e) == expected
        s = e.stats()
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
        assert s["step_time"]["forward"] > 0  # the workers' timings come back
    finally:
        e.close()
    assert all(not p.is_alive() for p in e.executor._procs)


def test_two_ranks_give_rank_zero_tokens(tiny_llama: Path) -> None:
    """Two worker processes in one gloo group (the model replicated until tensor-parallel
    sharding lands): the driver sends every rank each step and uses rank 0's tokens."""
    base = config(tiny_llama, num_kv_blocks=200)
    expected = run(LLMEngine(base))
    parallel = ParallelConfig(tensor_parallel_size=2, num_threads=1)
    assert parallel.distributed_executor_backend is ExecutorBackend.MP
    e = LLMEngine(dataclasses.replace(base, parallel=parallel))
    try:
        assert len(e.executor.pids) == 2  # type: ignore[attr-defined]
        assert run(e) == expected
    finally:
        e.close()


def test_a_killed_worker_is_a_clear_error(tiny_llama: Path) -> None:
    e = LLMEngine(config(tiny_llama, num_kv_blocks=200, distributed_executor_backend="mp"))
    try:
        for i, p in enumerate(PROMPTS):
            e.add_request(str(i), {"prompt_token_ids": p}, PARAMS[0])
        e.step()
        e.step()
        (pid,) = e.executor.pids  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"rank 0 \(pid {pid}\) died \(exit code -9\)"):
            e.step()
        with pytest.raises(WorkerDiedError, match="died"):  # and every later call, at once
            e.step()
        assert time.monotonic() - t0 < 30
    finally:
        e.close()


def test_a_worker_start_up_error_reaches_the_driver(tiny_llama: Path) -> None:
    cfg = config(tiny_llama, distributed_executor_backend="mp", attention_backend="CPU_KERNEL")
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="/nonexistent"))
    with pytest.raises(ValueError, match="is not a model folder"):
        MultiprocExecutor(bad)


def test_a_peers_death_is_named_over_the_error_it_caused(tiny_llama: Path) -> None:
    """Under tensor parallelism a killed rank makes its peers' collectives fail (gloo:
    connection reset), and that error can reach the driver before the death is seen: the
    error names the dead rank, not the peer that reported it."""
    e = LLMEngine(config(tiny_llama, num_kv_blocks=200, tensor_parallel_size=2,
                         distributed_executor_backend="mp"))  # fmt: skip
    try:
        executor = e.executor
        assert isinstance(executor, MultiprocExecutor)
        pid = executor.pids[1]
        os.kill(pid, signal.SIGKILL)
        executor._procs[1].join(timeout=10)
        # rank 0's answer to the step, as it arrives when rank 1 died in its all-reduce
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died \(exit code -9\)"):
            executor._raise(0, "execute", RuntimeError("Connection reset by peer"))
    finally:
        e.close()
