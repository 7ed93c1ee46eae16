"""A server's cost as the lab reads it from /proc: CPU-seconds and peak RSS of every process in
its session (a forked child included), and the per-point figures of a sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvserve.bench import proc_cost
from kvserve.bench.sweep import server_cost

# A session leader that forks a child; both hold 64 MiB and burn CPU, then wait to be read.
SCRIPT = """
import os, sys, time
child = os.fork()
block = bytearray(64 << 20)  # written: resident
for i in range(0, len(block), 4096): block[i] = 1
t = time.process_time()
while time.process_time() - t < 0.4: pass
sys.stdout.write("ready\\n" if child else ""); sys.stdout.flush()
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_session_usage_counts_the_forked_child() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(0.5)  # the child's own busy loop ends about when the parent's does
        usage = proc_cost.session_usage(proc.pid)
        assert usage is not None and usage.num_processes == 2
        assert usage.cpu_seconds >= 0.8  # 0.4 s each
        assert usage.peak_rss_bytes >= 2 * (64 << 20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child too
        proc.wait()
    deadline = time.monotonic() + 10  # the orphaned child is reaped by init
    while proc_cost.session_usage(proc.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_cost.session_usage(proc.pid) is None  # nobody left in the session


def test_server_cost_per_1k_output_tokens() -> None:
    before = proc_cost.SessionUsage(10.0, 100 << 20, 3)
    after = proc_cost.SessionUsage(16.5, 300 << 20, 3)
    runs = [{"total_output_tokens": 1000}, {"total_output_tokens": 3000}]
    assert server_cost(before, after, runs) == {
        "server_cpu_seconds": 6.5,
        "server_peak_rss_mib": 300.0,
        "server_cpu_s_per_1k_output_tokens": 1.625,
    }
    assert set(server_cost(None, after, runs).values()) == {None}
