"""benchmarks/study/makespan.py: list scheduling of a queue of fixed-length requests."""

from __future__ import annotations

import pytest

from benchmarks.study.makespan import makespan, priority_order


def test_a_long_request_last_sets_the_tail() -> None:
    # two lanes: the 10-step request after two 1-step ones ends at 11; first, at 10
    assert makespan([1, 1, 10], [0, 1, 2], lanes=2) == 11
    assert makespan([1, 1, 10], [2, 0, 1], lanes=2) == 10
    assert makespan([3, 3, 3, 3], range(4), lanes=4) == 3
    assert makespan([3, 3, 3, 3], range(4), lanes=1) == 12


def test_priority_order_is_class_then_arrival() -> None:
    assert priority_order([1, 0, 1, 0]) == [1, 3, 0, 2]


def test_lanes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lanes must be positive"):
        makespan([1], [0], lanes=0)
