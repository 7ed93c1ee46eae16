"""Arrival schedules (pure) and the runner's scheduling with a fake request function."""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest

from kvserve.bench.arrivals import arrival_times
from kvserve.bench.client import RequestInput, RequestRecord
from kvserve.bench.runner import run_requests


def test_seeded_determinism() -> None:
    a = arrival_times(100, 5.0, seed=7)
    assert a == arrival_times(100, 5.0, seed=7)
    assert a != arrival_times(100, 5.0, seed=8)
    assert a[0] == 0.0 and all(y >= x for x, y in itertools.pairwise(a))


def test_poisson_mean_rate_within_2_percent() -> None:
    # 20000 arrivals at 5 req/s: the mean gap must be 0.2 s within 2% (the standard error of
    # the mean gap is 0.7% here, so this is a ~3-sigma bound on an honest sampler).
    offsets = arrival_times(20000, 5.0, seed=0)
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert mean_gap == pytest.approx(0.2, rel=0.02)


def test_normalized_schedule_ends_exactly_on_time() -> None:
    offsets = arrival_times(50, 4.0, seed=3, normalize=True)
    assert offsets[-1] == pytest.approx(49 / 4.0, abs=1e-9)
    assert offsets[0] == 0.0


def test_constant_spacing_is_exact() -> None:
    assert arrival_times(5, 4.0, distribution="constant") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert arrival_times(3, 2.0, burstiness=float("inf")) == [0.0, 0.5, 1.0]


def test_infinite_rate_is_one_burst() -> None:
    assert arrival_times(6, float("inf"), burstiness=0.3) == [0.0] * 6
    assert arrival_times(0, 1.0) == []


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_gap_variance_as_gamma_predicts(burstiness: float) -> None:
    # Gamma(shape=k, mean=1/r) has variance 1/(k r^2): the squared coefficient of variation
    # of the gaps is 1/k (4 for bursty k=0.25, 1 for Poisson, 0.25 for smooth k=4).
    gaps = np.diff(arrival_times(50000, 5.0, burstiness=burstiness, seed=1))
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0 / burstiness, rel=0.1)


def test_invalid_arguments() -> None:
    for kwargs in ({"request_rate": 0.0}, {"request_rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrival_times(3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, distribution="uniform")  # type: ignore[arg-type]


def _inputs(n: int) -> list[RequestInput]:
    return [RequestInput("http://127.0.0.1:1/v1/completions", "m", f"p{i}", 1, 4) for i in range(n)]


async def test_concurrency_cap_is_never_exceeded() -> None:
    in_flight, peak, done = 0, 0, []

    async def fake_send(inp: RequestInput) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        start = time.perf_counter()
        await asyncio.sleep(0.01 + 0.01 * (int(inp.prompt[1:]) % 3))
        in_flight -= 1
        return RequestRecord(success=True, start_time=start, latency=time.perf_counter() - start)

    result = await run_requests(_inputs(30), fake_send, [0.0] * 30, 3, on_done=done.append)
    assert peak == 3  # reached, never exceeded
    assert len(result.records) == len(done) == 30
    assert max(r.queue_time for r in result.records) > 0.0  # later requests waited for a slot
    assert [r.queue_time for r in result.records[:3]] == pytest.approx([0, 0, 0], abs=0.005)


async def test_requests_are_sent_on_schedule() -> None:
    sent: list[float] = []
    t0 = time.perf_counter()

    async def fake_send(inp: RequestInput) -> RequestRecord:
        sent.append(time.perf_counter() - t0)
        return RequestRecord(success=True)

    offsets = [0.0, 0.1, 0.2, 0.3]
    result = await run_requests(_inputs(4), fake_send, offsets)
    # Never early (sleeps to absolute targets); late only by scheduler noise, which a shared
    # 2-core CI machine can stretch, hence the loose upper bound.
    for want, got in zip(offsets, sent, strict=True):
        assert want - 1e-3 <= got < want + 0.09
    assert result.duration >= 0.3 and 0.0 <= result.max_send_lag < 0.09


async def test_runner_validates_inputs() -> None:
    async def fake_send(inp: RequestInput) -> RequestRecord:
        return RequestRecord()

    with pytest.raises(ValueError):
        await run_requests(_inputs(2), fake_send, [0.0])
    with pytest.raises(ValueError):
        await run_requests(_inputs(1), fake_send, [0.0], max_concurrency=0)
