"""CPU-heavy request work (chat templates, tokenization) off the event loop, in a bounded pool.

One event loop serves every connection: a 1 MB prompt takes seconds to tokenize, and while
that runs on the loop no stream gets a token and ``/health`` does not answer (a load balancer
then pulls a healthy replica). So every template render and tokenization runs in a worker
thread. The threads are few, so that a burst of large requests queues instead of taking every
core from the engine and the loop (the tokenizer releases the GIL while it works; a template
render holds it between the interpreter's switches), and small jobs have their own thread, so
that they never wait behind large ones.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Jobs on at most this many characters take well under a millisecond: their own thread.
SMALL_JOB_CHARS = 4096
# Threads for larger jobs: half the cores (the engine's step needs the rest), 1 to 4.
LARGE_JOB_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _pool(lane: str) -> ThreadPoolExecutor:
    """The lane's executor, made on first use (shared by every app in the process)."""
    with _lock:
        pool = _pools.get(lane)
        if pool is None:
            workers = 1 if lane == "small" else LARGE_JOB_THREADS
            pool = _pools[lane] = ThreadPoolExecutor(workers, f"kvserve-cpu-{lane}")
        return pool


async def run_cpu(fn: Callable[[], T], small: bool) -> T:
    """``fn()`` on a worker thread of the small lane (``small``: its input is at most
    ``SMALL_JOB_CHARS`` characters) or the large one.

    A job that has not started when its request is cancelled (the client left) never runs."""
    pool = _pool("small" if small else "large")
    return await asyncio.get_running_loop().run_in_executor(pool, fn)
