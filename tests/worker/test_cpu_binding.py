"""``--cpu-cores``: the parser and the per-rank assignment (pure functions, exact outputs), a
bad value refused at start-up naming the flag, and the binding applied in a thread reads back
exactly (its own mask, one OpenMP thread per core)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import build_engine_config
from kvserve.worker.cpu_binding import (
    BindMode,
    CpuCoresSpec,
    assign_cores,
    bind_threads,
    omp_thread_cores,
    parse_core_list,
    parse_cpu_cores,
    read_numa_nodes,
)

TWO_NODES = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}


def test_core_lists_parse_in_order() -> None:
    assert parse_core_list("0-3") == (0, 1, 2, 3)
    assert parse_core_list("0, 2,4-5") == (0, 2, 4, 5)
    assert parse_core_list("7") == (7,)
    assert parse_cpu_cores("0-1|2-3") == CpuCoresSpec(BindMode.LIST, ((0, 1), (2, 3)))
    assert parse_cpu_cores(" AUTO ").mode is BindMode.AUTO
    assert parse_cpu_cores("nobind") == CpuCoresSpec(BindMode.NOBIND)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0-", "cpu_cores (--cpu-cores): '0-' is not a core list"),
        ("a,b", "cpu_cores (--cpu-cores): 'a,b' is not a core list"),
        ("3-1", "cpu_cores (--cpu-cores): range '3-1' in '3-1' runs backwards"),
        ("0,1,0-1", "cpu_cores (--cpu-cores): core(s) [0, 1] appear more than once"),
        ("0|", "cpu_cores (--cpu-cores): '' is not a core list"),
        ("", "cpu_cores (--cpu-cores): empty"),
    ],
)
def test_malformed_lists_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_cpu_cores(text)
    assert str(info.value).startswith(message)


def test_auto_one_rank_takes_the_whole_mask() -> None:
    spec = parse_cpu_cores("auto")
    assert assign_cores(spec, 1, {5, 1, 3}, TWO_NODES) == ((1, 3, 5),)
    # a thread count other than the group's: several small servers must not pin to core 0
    assert assign_cores(spec, 1, {0, 1, 2, 3}, TWO_NODES, num_threads=2) is None
    assert assign_cores(spec, 1, {0, 1}, TWO_NODES, num_threads=2) == ((0, 1),)


def test_auto_gives_each_rank_a_numa_node_where_there_are_enough() -> None:
    spec = parse_cpu_cores("auto")
    assert assign_cores(spec, 2, range(8), TWO_NODES) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # only the allowed cores of each node, cut to the smallest node's count (equal ranks)
    assert assign_cores(spec, 2, {1, 2, 3, 4, 5}, TWO_NODES) == ((1, 2), (4, 5))
    # one node (or none known): equal contiguous slices of the mask
    assert assign_cores(spec, 2, range(8), {0: tuple(range(8))}) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert assign_cores(spec, 4, range(8), TWO_NODES) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert assign_cores(spec, 2, {0, 1, 2}, {}) == ((0,), (1,))
    # more ranks than cores: unbound, as before binding existed (TP=3 on 2 cores runs)
    assert assign_cores(spec, 3, {0, 1}, {}) is None


def test_nobind_binds_nothing() -> None:
    assert assign_cores(parse_cpu_cores("nobind"), 2, range(8), TWO_NODES) is None


def test_lists_are_checked_against_the_ranks_and_the_mask() -> None:
    mask = set(range(8))
    assert assign_cores(parse_cpu_cores("4-7|0-3"), 2, mask, {}) == ((4, 5, 6, 7), (0, 1, 2, 3))
    assert assign_cores(parse_cpu_cores("0,2"), 1, mask, {}, num_threads=2) == ((0, 2),)
    bad = [
        ("0-3", 2, None, "cpu_cores (--cpu-cores): '0-3' gives 1 core group(s) for "
                         "tensor_parallel_size 2: give one group per rank"),
        ("0|1|2", 2, None, "'0|1|2' gives 3 core group(s) for tensor_parallel_size 2"),
        ("6-9", 1, None, "core(s) 8-9 of rank 0 are outside this process's affinity mask 0-7"),
        ("0-2|2-3", 2, None, "core(s) 2 are given to more than one rank"),
        ("0-3", 1, 2, "num_threads (--num-threads) 2 differs from the 4 core(s) cpu_cores "
                      "(--cpu-cores) gives rank 0"),
    ]  # fmt: skip
    for text, ranks, threads, message in bad:
        with pytest.raises(ValueError) as info:
            assign_cores(parse_cpu_cores(text), ranks, mask, {}, num_threads=threads)
        assert message in str(info.value)


def test_numa_nodes_are_read_from_sysfs(tmp_path: Path) -> None:
    for node, cpus in [(0, "0-3,8-11\n"), (1, "4-7,12-15\n"), (2, "\n")]:
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    (tmp_path / "possible").write_text("0-2\n")  # not a node
    assert read_numa_nodes(tmp_path) == {
        0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15), 2: (),
    }  # fmt: skip
    assert read_numa_nodes(tmp_path / "missing") == {}
    nodes = read_numa_nodes()  # this machine: every allowed core is on some node
    assert set(os.sched_getaffinity(0)) <= {c for cpus in nodes.values() for c in cpus}


def test_bad_values_fail_at_start_up_naming_the_flag(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"cpu_cores \(--cpu-cores\): core\(s\) {outside} "
                                         "of rank 0 are outside"):  # fmt: skip
        build_engine_config(str(tiny_llama), cpu_cores=str(outside))
    with pytest.raises(ValueError, match=r"cpu_cores \(--cpu-cores\): '0-x' is not a core"):
        build_engine_config(str(tiny_llama), cpu_cores="0-x")
    with pytest.raises(ValueError, match=r"'0' gives 1 core group\(s\) for tensor_parallel"):
        build_engine_config(str(tiny_llama), cpu_cores="0", tensor_parallel_size=2)
    # vLLM's variable is the flag's default, and its errors name the variable
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-")
    with pytest.raises(ValueError, match=r"^\$VLLM_CPU_OMP_THREADS_BIND: '0-' is not"):
        build_engine_config(str(tiny_llama))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert build_engine_config(str(tiny_llama)).parallel.cpu_cores == ((0,),)
    assert build_engine_config(str(tiny_llama), cpu_cores="nobind").parallel.cpu_cores is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_bound_thread_reads_back_its_cores() -> None:
    """In a fresh thread (its own OpenMP pool): confined to the group, OpenMP thread 1 pinned
    to the second core; the test's own thread and torch's count are restored after."""
    cores = tuple(sorted(os.sched_getaffinity(0))[:2])
    before = torch.get_num_threads()
    seen: dict[str, object] = {}

    def run() -> None:
        seen["pinned"] = bind_threads(cores, None, worker=False)
        seen["mask"] = os.sched_getaffinity(0)
        seen["threads"] = torch.get_num_threads()
        seen["omp"] = omp_thread_cores(2)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    torch.set_num_threads(before)
    assert seen == {"pinned": True, "mask": set(cores), "threads": 2,
                    "omp": (cores, (cores[1],))}  # fmt: skip


def test_import_kvserve_sets_the_wait_policy_only_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    for code, expected in [
        ("import kvserve; " + show, "PASSIVE"),
        ("import torch, kvserve; " + show, "None"),  # libgomp already read it: left unset
    ]:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == expected
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's choice wins
    out = subprocess.run([sys.executable, "-c", "import kvserve; " + show], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "ACTIVE"
