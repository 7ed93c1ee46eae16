"""Keep big freed blocks in the C heap for reuse instead of handing them back to the OS.

On CPU every large activation (a prefill step's ``[tokens, intermediate]`` MLP output is
~45 MB) is a fresh ``malloc``. glibc serves blocks above its mmap threshold (at most 32 MB
by default) with a new ``mmap`` and unmaps them on ``free``, so each step touches tens of
thousands of fresh pages. A page fault is cheap on bare metal, but in a VM it can cost
several microseconds: measured here, one 3840-row gate/up projection took 90 ms with
10,561 faults and 21 ms without (``benchmarks/page_faults.py`` measures it). vLLM's CPU backend
asks users to preload tcmalloc for the same reason; raising glibc's mmap and trim
thresholds gets the same reuse without a preload.

The cost: the process keeps up to ``TRIM_THRESHOLD`` of freed heap instead of returning it.
``KVSERVE_MALLOC_TUNING=0`` turns this off. So that the cost lasts only while the engine
works, the engine hands the freed heap back (``trim_heap``) once it has been idle for
``IDLE_TRIM_SECONDS``: measured with ``benchmarks/adversarial_soak.py`` (built-in model, AVX2
EPYC), the server kept +385 MiB of RSS after the attacks without it (see docs/server.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap; the largest activations stay well under it, while
# the KV cache (allocated before tuning) keeps its own mappings.
MMAP_THRESHOLD = 1 << 30
# Free heap kept before glibc trims; mallopt takes an int, so this is its maximum.
TRIM_THRESHOLD = 2**31 - 1
# Idle this long after work, the engine trims the heap. Long enough that a steady stream of
# requests with short gaps keeps its warm heap (a trim makes the next big prefill fault its
# pages in again: 90 ms instead of 21 ms for one 3840-row projection in a VM), short enough
# that an idle server's RSS returns to its resting size within seconds.
IDLE_TRIM_SECONDS = 2.0


def glibc_function(name: str) -> Any | None:
    """glibc's ``name`` (``mallopt``, ``malloc_trim``) through ctypes; None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _mallopt() -> Any | None:
    """glibc's ``mallopt`` ready to call, or None off glibc or with ``KVSERVE_MALLOC_TUNING=0``
    (kvserve then leaves the allocator as it is)."""
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0":
        return None
    mallopt = glibc_function("mallopt")
    if mallopt is not None:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds for this process; True if they were applied."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused kvserve's thresholds; large buffers stay mmap'd")
    return ok


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere a no-op).

    A layer's dense weight and temporaries are freed once it is quantized, but glibc keeps
    freed blocks below its mmap threshold (raised up to 32 MB as large blocks are freed) in
    the heap, between the quantized layers' long-lived codes, and does not give them back.
    Measured with ``load_model`` on the TinyLlama-1.1B-shaped model (bf16, prepacked;
    ``benchmarks/load_memory.py --mode load``), a trim after each layer against none:
    int4 peak 1.69 GB (1.89), RSS after loading 1.26 GB (1.71); int8 1.92 GB (2.07),
    1.61 GB (1.95). It costs load time (freed pages are faulted in again: int4 13 s, 10 s
    without). A fixed 1 MB mmap threshold instead (``mallopt``) peaked lower still (int4
    1.40 GB) but doubled the load time and would change the process's allocator for good.
    The engine also trims once idle (``IDLE_TRIM_SECONDS``), undoing ``keep_freed_memory``'s
    cost between bursts of work."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    fn = glibc_function("malloc_trim")
    if fn is not None:
        fn.argtypes = [ctypes.c_size_t]
    return fn  # type: ignore[no-any-return]


# Inside ``own_mappings``: blocks from this size up get their own mmap (glibc's default
# ceiling for its dynamic threshold is 32 MiB; 1 MiB catches every KV and weight tensor)
OWN_MAPPING_THRESHOLD = 1 << 20


def load_in_own_mappings() -> None:
    """Blocks from ``OWN_MAPPING_THRESHOLD`` up get their own mmaps until ``keep_freed_memory``
    raises the threshold: for an engine with sleep mode, whose first weights must go back to
    the OS at level 2 as wholly as the ones ``own_mappings`` makes on wake. Loaded under
    glibc's dynamic threshold (raised by the loader's freed temporaries), the tiny Qwen3
    sleep test's weights gave back 20 of their 24 MiB on an AVX512 EPYC, under the test's
    lower bound (it held on the AVX2 kind); loaded so, the test passes on both."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, OWN_MAPPING_THRESHOLD)


@contextlib.contextmanager
def own_mappings(tuned: bool) -> Iterator[None]:
    """Allocate long-lived large tensors (a KV cache or weights made again on wake from
    sleep) in their own mmaps while ``keep_freed_memory`` is in force (``tuned``), so that
    freeing them later unmaps them: back to the OS at once, whatever the heap around them
    holds. Measured on the tiny-Llama sleep test: a KV cache re-made in the heap and then
    freed gave back 41 of its 64 MiB after ``malloc_trim`` (live blocks above it pin the
    rest); in its own mappings, all of it. Process-wide while it lasts (glibc's threshold is
    one), so it is for the engine thread while the engine is idle."""
    mallopt = _mallopt() if tuned else None
    if mallopt is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, OWN_MAPPING_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
