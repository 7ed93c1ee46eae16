"""Which cores each rank's OpenMP threads run on: ``--cpu-cores`` (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``), and the OpenMP wait policy of worker processes.

The policy is pure functions over plain values (tested with exact outputs):
``parse_cpu_cores`` reads the flag, ``assign_cores`` turns it into one core group per rank
given the process's affinity mask and the NUMA nodes. ``resolve_cpu_cores`` feeds them this
machine's facts (in the engine's process, before any worker starts, so a bad value fails at
start-up naming the flag). ``bind_threads`` applies a rank's group in the thread that runs its
model: the thread's (or the whole worker process's) mask, ``torch.set_num_threads`` with one
thread per core, and each OpenMP thread pinned to its own core.

Pinning each OpenMP thread: torch's pool belongs to its libgomp, so the pool's threads are
reached by calling libgomp's ``GOMP_parallel`` (what ``#pragma omp parallel`` compiles to)
through ctypes with a callback: each team member sets its own mask (``sched_setaffinity`` of
the calling thread) by its ``omp_get_thread_num``, as vLLM's ``init_cpu_threads_env`` does in
C++. Later parallel regions of the same thread reuse the same pool threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvserve.worker")

FLAG = "cpu_cores (--cpu-cores)"
ENV_ALIAS = "VLLM_CPU_OMP_THREADS_BIND"
NUMA_ROOT = Path("/sys/devices/system/node")

Groups = tuple[tuple[int, ...], ...]

# libgomp's wait policy for kvserve's processes unless the user set one. Beside other busy
# processes a spinning waiter holds the core its teammate needs: decode steps of the built-in
# model on a loaded 2-core AVX2 EPYC took 71 / 479 ms (batch 1 / 8) with PASSIVE against 986 /
# 2741 ms with libgomp's default spin and 1292 / 4247 ms with ACTIVE (medians, with a busy
# co-runner 249 / 352 against 817 / 2995 ms; docs/performance.md, benchmarks/omp_wait_policy.py).
WAIT_POLICY = "PASSIVE"


class BindMode(enum.Enum):
    AUTO = "auto"  # the process's affinity mask (one NUMA node per rank where there are several)
    NOBIND = "nobind"  # threads float; only the thread count is set
    LIST = "list"  # the cores given, one group per rank


@dataclass(frozen=True)
class CpuCoresSpec:
    """``--cpu-cores`` as parsed: a mode and, for ``LIST``, one core group per rank."""

    mode: BindMode
    groups: Groups = ()
    source: str = FLAG  # what to name in errors: the flag, or the environment variable


def parse_core_list(text: str, source: str = FLAG) -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``: comma-separated cores and inclusive ranges, in the
    order given; a core given twice, an empty list or a reversed range is an error."""
    cores: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if m is None:
            raise ValueError(f"{source}: {text!r} is not a core list like '0-3' or '0,2,4-5' "
                             f"(bad item {item.strip()!r})")  # fmt: skip
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"{source}: range {item.strip()!r} in {text!r} runs backwards")
        cores.extend(range(lo, hi + 1))
    dup = sorted({c for c in cores if cores.count(c) > 1})
    if dup:
        raise ValueError(f"{source}: core(s) {dup} appear more than once in {text!r}")
    return tuple(cores)


def parse_cpu_cores(text: str, source: str = FLAG) -> CpuCoresSpec:
    """``auto``, ``nobind``, or core lists one per rank separated by ``|`` (``0-3|4-7``)."""
    value = text.strip()
    if value.lower() in ("auto", "nobind"):
        return CpuCoresSpec(BindMode(value.lower()), (), source)
    if not value:
        raise ValueError(f"{source}: empty; give 'auto', 'nobind' or a core list like '0-3'")
    groups = tuple(parse_core_list(g, source) for g in value.split("|"))
    return CpuCoresSpec(BindMode.LIST, groups, source)


def read_numa_nodes(root: Path = NUMA_ROOT) -> dict[int, tuple[int, ...]]:
    """NUMA node -> its CPUs (``nodeN/cpulist``); {} where the kernel exposes none."""
    nodes: dict[int, tuple[int, ...]] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return nodes
    for entry in entries:
        m = re.fullmatch(r"node(\d+)", entry.name)
        if m is None:
            continue
        try:
            text = (entry / "cpulist").read_text().strip()
        except OSError:
            continue
        nodes[int(m[1])] = parse_core_list(text, str(entry / "cpulist")) if text else ()
    return dict(sorted(nodes.items()))


def assign_cores(
    spec: CpuCoresSpec,
    world_size: int,
    allowed: Iterable[int],
    nodes: Mapping[int, tuple[int, ...]],
    num_threads: int | None = None,
) -> Groups | None:
    """One core group per rank (None: no binding). ``allowed``: the process's affinity mask;
    ``nodes``: NUMA node -> CPUs; ``num_threads``: ``--num-threads`` if given.

    ``auto``: one rank gets every allowed core; several ranks get one NUMA node's allowed
    cores each where there are at least as many nodes with allowed cores as ranks, else equal
    contiguous slices of the allowed cores (equal: tensor-parallel ranks wait for the slowest).
    ``auto`` with a ``num_threads`` other than its group's size binds nothing: several small
    servers on one host would otherwise all pin to the same first cores.
    A list is checked: one group per rank, no core twice, every core in the mask, and
    ``num_threads`` (if given) equal to each group's size (one thread per core)."""
    mask = sorted(set(allowed))
    if spec.mode is BindMode.NOBIND:
        return None
    if spec.mode is BindMode.AUTO:
        groups = _auto_groups(spec, world_size, mask, nodes)
        if groups is None or (
            num_threads is not None and any(len(g) != num_threads for g in groups)
        ):
            return None
        return groups
    return _checked_list(spec, world_size, set(mask), num_threads)


def _auto_groups(
    spec: CpuCoresSpec, world_size: int, mask: list[int], nodes: Mapping[int, tuple[int, ...]]
) -> Groups | None:
    if len(mask) < world_size:
        # More ranks than cores (a TP=3 test on 2 cores, a model whose heads need 3 ranks on
        # a small VM) ran before binding existed: it still runs, unbound, rather than failing.
        logger.info("%s: auto: %d ranks but this process may use only %s: threads not bound",
                    spec.source, world_size, _show(mask))  # fmt: skip
        return None
    if world_size == 1:
        return (tuple(mask),)
    per_node = [tuple(c for c in cpus if c in set(mask)) for _, cpus in sorted(nodes.items())]
    per_node = [g for g in per_node if g]
    if len(per_node) >= world_size:
        size = min(len(g) for g in per_node[:world_size])
        return tuple(g[:size] for g in per_node[:world_size])
    size = len(mask) // world_size
    return tuple(tuple(mask[r * size : (r + 1) * size]) for r in range(world_size))


def _checked_list(
    spec: CpuCoresSpec, world_size: int, mask: set[int], num_threads: int | None
) -> Groups:
    groups = spec.groups
    if len(groups) != world_size:
        raise ValueError(
            f"{spec.source}: {_show_groups(groups)} gives {len(groups)} core group(s) for "
            f"tensor_parallel_size {world_size}: give one group per rank, separated by '|' "
            "(e.g. '0-3|4-7')"
        )
    seen: set[int] = set()
    for rank, group in enumerate(groups):
        outside = sorted(set(group) - mask)
        if outside:
            raise ValueError(
                f"{spec.source}: core(s) {_show(outside)} of rank {rank} are outside this "
                f"process's affinity mask {_show(sorted(mask))}"
            )
        shared = sorted(seen & set(group))
        if shared:
            raise ValueError(f"{spec.source}: core(s) {_show(shared)} are given to more than "
                             "one rank")  # fmt: skip
        seen |= set(group)
        if num_threads is not None and num_threads != len(group):
            raise ValueError(
                f"num_threads (--num-threads) {num_threads} differs from the {len(group)} "
                f"core(s) {spec.source} gives rank {rank}: one thread runs per core; leave "
                "--num-threads unset"
            )
    return groups


def _show(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    out: list[str] = []
    for c in sorted(cores):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out) or "(none)"


def _show_groups(groups: Groups) -> str:
    return repr("|".join(_show(g) for g in groups))


def resolve_cpu_cores(value: str | None, world_size: int, num_threads: int | None) -> Groups | None:
    """``--cpu-cores`` (None: ``$VLLM_CPU_OMP_THREADS_BIND``, else ``auto``) on this machine:
    this process's affinity mask and NUMA nodes. Raises ``ValueError`` naming the source."""
    source = FLAG
    if value is None:
        value, source = os.environ.get(ENV_ALIAS), f"${ENV_ALIAS}"
        if value is None:
            value, source = "auto", FLAG
    spec = parse_cpu_cores(value, source)
    return assign_cores(spec, world_size, os.sched_getaffinity(0), read_numa_nodes(), num_threads)


# -- applying a group -------------------------------------------------------------------------


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp (the one its thread pool lives in), or None (another OpenMP runtime)."""
    try:
        import torch  # noqa: F401 (loads libgomp)

        maps = Path("/proc/self/maps").read_text().splitlines()
    except (ImportError, OSError):
        return None
    paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    if not paths:
        return None
    # torch's own copy first: the system's (the C++ kernels') resolves to it by soname anyway
    path = next((p for p in paths if "/torch/" in p), paths[0])
    lib = ctypes.CDLL(path)  # releases the GIL while GOMP_parallel runs; callbacks retake it
    lib.GOMP_parallel.argtypes = [_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    lib.GOMP_parallel.restype = None
    lib.omp_get_thread_num.restype = ctypes.c_int
    return lib


_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _each_omp_thread(num_threads: int, fn: object) -> dict[int, tuple[int, ...]] | None:
    """Run ``fn(thread_num)`` on each of ``num_threads`` OpenMP threads of this thread's team;
    returns each thread's affinity afterwards (None without libgomp)."""
    lib = _libgomp()
    if lib is None:
        return None
    masks: dict[int, tuple[int, ...]] = {}

    def body(_: int | None) -> None:
        i = int(lib.omp_get_thread_num())
        fn(i)  # type: ignore[operator]
        masks[i] = tuple(sorted(os.sched_getaffinity(0)))

    lib.GOMP_parallel(_BODY(body), None, num_threads, 0)
    return masks


def omp_thread_cores(num_threads: int) -> tuple[tuple[int, ...], ...]:
    """Each OpenMP thread's affinity as read back by the thread itself, in thread order
    (() where the OpenMP runtime is not libgomp)."""
    masks = _each_omp_thread(num_threads, lambda i: None)
    return () if masks is None else tuple(masks[i] for i in sorted(masks))


def bind_threads(group: tuple[int, ...] | None, num_threads: int | None, worker: bool) -> bool:
    """Apply a rank's binding in the thread that will run its model; returns whether each
    OpenMP thread is pinned to its own core.

    ``worker``: the process is a worker's own, so every thread it has is confined to the group
    and the calling thread (OpenMP thread 0) is pinned to the group's first core, like the
    others. Otherwise (the engine's process, which may serve HTTP or run a user's code) only
    the calling thread is confined, to the whole group, and OpenMP threads 1.. are pinned."""
    threads = len(group) if group else num_threads
    if group:
        if worker:
            for tid in os.listdir("/proc/self/task"):
                # a thread that just ended, or one that is not ours to move, is skipped
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.sched_setaffinity(int(tid), group)
        else:
            os.sched_setaffinity(0, group)
    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if not group:
        return False

    def pin(i: int) -> None:
        if i > 0 or worker:
            os.sched_setaffinity(0, (group[i],))

    masks = _each_omp_thread(len(group), pin)
    if masks is None:
        logger.warning("OpenMP runtime is not libgomp: threads confined to cores %s, not "
                       "pinned one per core", _show(group))  # fmt: skip
        return False
    return True


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """``OMP_WAIT_POLICY`` (``WAIT_POLICY`` unless the user set one) in the environment the
    worker processes are spawned with, then the driver's own back. libgomp reads it once, when
    ``import torch`` loads it, so a worker can only get it from its start environment; the
    driver's own libgomp was loaded long before and is not affected."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
