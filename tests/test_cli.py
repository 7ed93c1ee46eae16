"""The top-level CLI's thread defaults."""

from __future__ import annotations

import os

from kvserve.cli import build_parser, default_num_threads


def test_serve_sets_threads_explicitly() -> None:
    args = build_parser().parse_args(["serve"])
    assert default_num_threads(args) == (os.cpu_count() or 1)


def test_explicit_threads_win_and_offline_keeps_torch_default() -> None:
    assert default_num_threads(build_parser().parse_args(["serve", "--num-threads", "2"])) == 2
    assert default_num_threads(build_parser().parse_args(["generate", "hi"])) is None


def test_serve_threads_are_per_rank() -> None:
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert default_num_threads(args) == max(1, (os.cpu_count() or 1) // 2)
