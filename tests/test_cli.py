"""The top-level CLI's thread defaults."""

from __future__ import annotations

import os

import pytest

from kvserve.cli import build_parser, default_num_threads


def test_serve_with_binding_leaves_the_count_to_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # --cpu-cores auto (the default) runs one thread per bound core: no count of its own
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert default_num_threads(build_parser().parse_args(["serve"])) is None
    args = build_parser().parse_args(["serve", "--cpu-cores", "0"])
    assert default_num_threads(args) is None


def test_serve_nobind_sets_threads_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = build_parser().parse_args(["serve", "--cpu-cores", "nobind"])
    assert default_num_threads(args) == len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM's variable, same meaning
    assert default_num_threads(build_parser().parse_args(["serve"])) == len(os.sched_getaffinity(0))


def test_explicit_threads_win_and_offline_keeps_torch_default() -> None:
    assert default_num_threads(build_parser().parse_args(["serve", "--num-threads", "2"])) == 2
    assert default_num_threads(build_parser().parse_args(["generate", "hi"])) is None


def test_serve_threads_are_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2", "--cpu-cores", "nobind"]
    )
    assert default_num_threads(args) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_serve_refuses_a_core_outside_the_mask_before_starting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.cli import main

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    outside = max(os.sched_getaffinity(0)) + 1
    assert main(["serve", "--cpu-cores", str(outside)]) == 2
    err = capsys.readouterr().err
    assert f"kvserve: error: cpu_cores (--cpu-cores): core(s) {outside} of rank 0 are" in err
