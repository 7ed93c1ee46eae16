"""calculate_metrics on hand-made records, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from kvserve.bench.client import RequestRecord
from kvserve.bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_percentiles,
    parse_slo,
    peak_concurrency,
)


def _records() -> list[RequestRecord]:
    # TPOT: r1 = (0.5 - 0.1) / 4 = 100 ms; r2 has one output token (no TPOT);
    # r3 = (0.9 - 0.3) / 2 = 300 ms; r4 failed and must not count anywhere but `failed`.
    return [
        RequestRecord(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1], start_time=0.0),
        RequestRecord(success=True, prompt_len=20, output_tokens=1, ttft=0.2, latency=0.2,
                      start_time=0.1),
        RequestRecord(success=True, prompt_len=30, output_tokens=3, ttft=0.3, latency=0.9,
                      itl=[0.2, 0.4], start_time=0.2),
        RequestRecord(success=False, error="HTTP 500: boom", prompt_len=40, output_tokens=0,
                      ttft=0.0, latency=0.05, start_time=0.0),
    ]  # fmt: skip


def test_counts_and_throughput() -> None:
    m = calculate_metrics(_records(), duration=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.request_goodput is None  # no SLO given
    assert m.max_concurrent_requests == 3


def test_ttft_e2el_statistics_exclude_failed() -> None:
    lat = calculate_metrics(_records(), duration=2.0).latency
    assert lat["mean_ttft_ms"] == pytest.approx(200.0)
    assert lat["median_ttft_ms"] == pytest.approx(200.0)
    assert lat["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert lat["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation, rank 1.8
    assert lat["p99_ttft_ms"] == pytest.approx(298.0)
    assert lat["mean_e2el_ms"] == pytest.approx(1600 / 3)
    assert lat["median_e2el_ms"] == pytest.approx(500.0)
    assert lat["p99_e2el_ms"] == pytest.approx(892.0)


def test_tpot_excludes_one_token_outputs() -> None:
    lat = calculate_metrics(_records(), duration=2.0).latency
    assert lat["mean_tpot_ms"] == pytest.approx(200.0)  # (100 + 300) / 2, r2 left out
    assert lat["std_tpot_ms"] == pytest.approx(100.0)
    assert lat["p90_tpot_ms"] == pytest.approx(280.0)


def test_itl_pools_all_gaps() -> None:
    lat = calculate_metrics(_records(), duration=2.0).latency
    assert lat["mean_itl_ms"] == pytest.approx(1000 / 6)
    assert lat["median_itl_ms"] == pytest.approx(100.0)
    assert lat["p90_itl_ms"] == pytest.approx(300.0)
    assert lat["p99_itl_ms"] == pytest.approx(390.0)


def test_extra_percentiles_keys() -> None:
    lat = calculate_metrics(_records(), 2.0, percentiles=parse_percentiles("50,99.9")).latency
    assert lat["p50_ttft_ms"] == pytest.approx(200.0)
    assert lat["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert "p90_ttft_ms" in lat and "p99_ttft_ms" in lat  # always reported


def test_goodput_with_slo() -> None:
    # ttft <= 250 and tpot <= 150: r1 (100, 100) and r2 (200, one token = 0) pass; r3 fails.
    m = calculate_metrics(_records(), 2.0, slo=parse_goodput(["ttft:250", "tpot:150"]))
    assert m.request_goodput == pytest.approx(1.0)
    # e2e <= 400: only r2 (200 ms) passes.
    m = calculate_metrics(_records(), 2.0, slo=parse_slo("e2e=400"))
    assert m.request_goodput == pytest.approx(0.5)


def test_all_failed_gives_none_not_zero() -> None:
    records = [RequestRecord(success=False, error="x", latency=0.1)]
    m = calculate_metrics(records, duration=1.0)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 1, 0)
    assert m.latency["mean_ttft_ms"] is None
    assert m.latency["p99_tpot_ms"] is None
    assert m.to_dict()["request_throughput"] == 0.0


def test_parsers_reject_bad_input() -> None:
    assert parse_slo("ttft=500,tpot=50,e2e=2000") == {"ttft": 500, "tpot": 50, "e2el": 2000}
    with pytest.raises(ValueError):
        parse_goodput(["ttft=500"])
    with pytest.raises(ValueError):
        parse_slo("speed=3")
    with pytest.raises(ValueError):
        parse_percentiles("101")
    with pytest.raises(ValueError):
        calculate_metrics([], duration=0.0)


def test_peak_concurrency_half_open() -> None:
    back_to_back = [
        RequestRecord(start_time=0.0, latency=1.0),
        RequestRecord(start_time=1.0, latency=1.0),
    ]
    assert peak_concurrency(back_to_back) == 1
