"""glibc keeps big freed blocks for reuse once kvserve tunes it (no fresh pages per step)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Allocates, touches and frees a 64 MiB buffer (above glibc's default mmap threshold) a few
# times, as steps do, then counts the minor page faults of doing it once more. (The first
# rounds can fault: small allocations may split the freed block until the heap settles.)
PROBE = """
import resource, torch
import kvserve.engine.llm  # the engine's process, as a server's: its imports shape the heap
from kvserve.ops.malloc_tuning import keep_freed_memory
print(keep_freed_memory())
for _ in range(3):
    torch.ones(1 << 26, dtype=torch.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(1 << 26, dtype=torch.uint8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_probe(tuning: str) -> tuple[str, int]:
    env = dict(os.environ, KVSERVE_MALLOC_TUNING=tuning)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_freed_buffer_is_reused_without_faults() -> None:
    applied, faults = run_probe("1")
    assert applied == "True"
    assert faults < 100  # the block came back from the heap, already mapped


def test_without_tuning_every_buffer_faults_in_fresh_pages() -> None:
    applied, faults = run_probe("0")
    assert applied == "False"
    assert faults >= (1 << 26) // 4096  # one fault per 4 KiB page at least
