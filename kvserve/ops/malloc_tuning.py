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
``KVSERVE_MALLOC_TUNING=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Any

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap; the largest activations stay well under it, while
# the KV cache (allocated before tuning) keeps its own mappings.
MMAP_THRESHOLD = 1 << 30
# Free heap kept before glibc trims; mallopt takes an int, so this is its maximum.
TRIM_THRESHOLD = 2**31 - 1


def glibc_function(name: str) -> Any | None:
    """glibc's ``name`` (``mallopt``, ``malloc_trim``) through ctypes; None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds for this process; True if they were applied."""
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0":
        return False
    mallopt = glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused kvserve's thresholds; large buffers stay mmap'd")
    return ok
