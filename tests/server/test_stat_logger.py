"""vLLM's periodic stats line (``kvserve/server/stat_logger.py``): its numbers from two stats
snapshots, INFO while busy and DEBUG when idle, and the interval's variable."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvserve.server.stat_logger import StatLogger, log_interval


def test_lines_from_the_engines_stats() -> None:
    stats: dict[str, Any] = {
        "num_prompt_tokens": 100,
        "num_generation_tokens": 10,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
    }
    now = [0.0]
    logger = StatLogger(lambda: {"m": lambda: dict(stats)}, 10.0, clock=lambda: now[0])
    assert logger.log_once() == []  # the baseline only
    now[0] = 2.0
    stats.update(
        num_prompt_tokens=300,
        num_generation_tokens=50,
        num_running=3,
        num_queued=1,
        kv_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    stats_logger = logging.getLogger("kvserve.stats")
    stats_logger.addHandler(handler)
    old_level = stats_logger.level
    stats_logger.setLevel(logging.DEBUG)
    try:
        lines = logger.log_once()
        assert lines == [
            "m: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 "
            "tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache "
            "hit rate: 25.0%"
        ]
        now[0] = 4.0
        stats.update(num_running=0, num_queued=0, kv_usage=0.0)
        idle = logger.log_once()
        assert idle[0].startswith("m: Avg prompt throughput: 0.0 tokens/s")
    finally:
        stats_logger.removeHandler(handler)
        stats_logger.setLevel(old_level)
    levels = [r.levelno for r in records]
    assert levels == [logging.INFO, logging.DEBUG]  # an idle server stays quiet


def test_interval_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    assert log_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert log_interval() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL must be a positive"):
            log_interval()
