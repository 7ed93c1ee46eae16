"""The pooling of embedding requests' hidden states, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.config import PoolingType
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.pooling_params import PoolingParams, PoolingSpec, truncate_prompt
from kvserve.sampling_params import SamplingParams
from kvserve.worker.pooling import Pooler, pool

HIDDEN = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]])  # 3 positions, H = 2


def test_last_pooling_is_the_last_row_normalised() -> None:
    got = pool(HIDDEN, PoolingType.LAST)
    norm = math.sqrt(5.0**2 + 9.0**2)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([5.0 / norm, 9.0 / norm], abs=1e-7)
    assert pool(HIDDEN, PoolingType.LAST, normalize=False).tolist() == [5.0, 9.0]


def test_mean_pooling_is_the_row_mean_normalised() -> None:
    # mean = [3, 5]; |[3, 5]| = sqrt(34)
    assert pool(HIDDEN, PoolingType.MEAN, normalize=False).tolist() == [3.0, 5.0]
    got = pool(HIDDEN, PoolingType.MEAN)
    assert got.tolist() == pytest.approx([3 / math.sqrt(34), 5 / math.sqrt(34)], abs=1e-7)


def test_bfloat16_rows_are_pooled_in_float32() -> None:
    got = pool(HIDDEN.to(torch.bfloat16), PoolingType.MEAN, normalize=False)
    assert got.dtype == torch.float32 and got.tolist() == [3.0, 5.0]


def test_a_zero_vector_stays_zero_when_normalised() -> None:
    assert pool(torch.zeros(2, 3), PoolingType.MEAN).tolist() == [0.0, 0.0, 0.0]


def _request(rid: str, n: int, kind: PoolingType, normalize: bool = True) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(), 0, [],
                   pooling=PoolingSpec(kind, normalize))  # fmt: skip


def _step(reqs: list[tuple[Request, int]]) -> SchedulerOutput:
    """A step computing ``n`` more tokens of each request (block tables are not read)."""
    return SchedulerOutput([r for r, _ in reqs], {r.request_id: n for r, n in reqs}, {})


def _run_chunks(pooler: Pooler, req: Request, hidden: torch.Tensor, chunk: int) -> list[float]:
    """Feed ``hidden`` (one row per prompt position) chunk by chunk, as chunked prefill does."""
    pooled: dict[str, list[float]] = {}
    while req.num_computed_tokens < req.num_prompt_tokens:
        n = min(chunk, req.num_prompt_tokens - req.num_computed_tokens)
        start = req.num_computed_tokens
        pooled, sums = pooler.step(_step([(req, n)]), hidden[start : start + n])
        pooler.commit(sums)
        req.num_computed_tokens += n  # the scheduler's update
    return pooled[req.request_id]


@pytest.mark.parametrize("kind", list(PoolingType))
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_chunked_prefill_pools_as_one_piece(kind: PoolingType, chunk: int) -> None:
    hidden = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    pooler = Pooler()
    got = _run_chunks(pooler, _request("a", 7, kind), hidden, chunk)
    assert got == pytest.approx(pool(hidden, kind).tolist(), abs=1e-6)
    assert len(pooler) == 0  # the finished request's sum is gone


def test_only_the_step_that_ends_the_prompt_returns_a_vector() -> None:
    pooler = Pooler()
    mean, last = _request("m", 3, PoolingType.MEAN), _request("l", 3, PoolingType.LAST)
    pooled, sums = pooler.step(_step([(mean, 2), (last, 2)]), HIDDEN[:2].repeat(2, 1))
    assert pooled == {} and set(sums) == {"m"}  # last pooling keeps no state


def test_requests_in_one_batch_read_their_own_rows() -> None:
    a = _request("a", 2, PoolingType.MEAN, normalize=False)
    b = _request("b", 1, PoolingType.LAST, normalize=False)
    gen = Request("g", [5, 6], SamplingParams(), 4, [])  # a generation row in between
    sched = SchedulerOutput([a, gen, b], {"a": 2, "g": 2, "b": 1}, {})
    rows = torch.tensor([[1.0, 1.0], [3.0, 5.0], [9.0, 9.0], [9.0, 9.0], [7.0, 8.0]])
    pooled, _ = Pooler().step(sched, rows)
    assert pooled == {"a": [2.0, 3.0], "b": [7.0, 8.0]}


def test_a_restart_at_position_zero_pools_afresh() -> None:
    """Preempted with recompute: the prompt runs again from 0 and the old sum is dropped."""
    pooler = Pooler()
    req = _request("a", 3, PoolingType.MEAN, normalize=False)
    _, sums = pooler.step(_step([(req, 2)]), torch.full((2, 2), 100.0))
    pooler.commit(sums)
    assert _run_chunks(pooler, req, HIDDEN, 2) == [3.0, 5.0]


def test_an_uncommitted_step_adds_nothing() -> None:
    """A step retried request by request (fault isolation) computes its chunk again."""
    pooler = Pooler()
    req = _request("a", 3, PoolingType.MEAN, normalize=False)
    pooler.step(_step([(req, 2)]), HIDDEN[:2])  # failed later in the step: not committed
    assert _run_chunks(pooler, req, HIDDEN, 2) == [3.0, 5.0]


def test_a_chunk_the_sum_does_not_reach_fails_instead_of_pooling_wrong() -> None:
    req = _request("a", 3, PoolingType.MEAN)
    req.num_computed_tokens = 2
    with pytest.raises(RuntimeError, match="resumes at position 2"):
        Pooler().step(_step([(req, 1)]), HIDDEN[2:])


def test_forget_drops_partial_sums() -> None:
    pooler = Pooler()
    req = _request("a", 3, PoolingType.MEAN)
    pooler.commit(pooler.step(_step([(req, 2)]), HIDDEN[:2])[1])
    assert len(pooler) == 1
    pooler.forget({"a", "unknown"})
    assert len(pooler) == 0


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    ids = [1, 2, 3, 4, 5]
    assert truncate_prompt(ids, None, 4) == ids
    assert truncate_prompt(ids, 2, 4) == [4, 5]
    assert truncate_prompt(ids, 9, 4) == ids
    assert truncate_prompt(ids, -1, 4) == [2, 3, 4, 5]  # -1: the context length


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"normalize": 1}, "normalize"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_pooling_params_refuse_bad_values(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(ValueError, match=param) as e:
        PoolingParams(**kwargs)  # type: ignore[arg-type]
    assert getattr(e.value, "param", None) == param
