"""What a server costs the machine: CPU-seconds and peak resident memory of its processes.

A server started by the lab (``sweep.ServerProcess``) leads its own session, so every process
it forks (vLLM's engine core and workers, kvserve's tensor-parallel ranks) carries the
leader's pid as its session id. Read from Linux's ``/proc``, no dependency; elsewhere every
figure is None. CPU-seconds are user + system time of the session's live processes plus what
they reaped of their exited children; peak memory is the sum of each process's own high-water
mark (``VmHWM``): an upper bound of the session's peak, exact for a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class SessionUsage:
    cpu_seconds: float  # user + system, the session's processes and their reaped children
    peak_rss_bytes: int  # sum of the processes' VmHWM
    num_processes: int


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:  # gone meanwhile
        return None
    # "pid (comm) state ppid pgrp session ..."; comm may hold spaces and parentheses
    return text[text.rindex(")") + 2 :].split()


def _hwm_bytes(pid: str) -> int:
    try:
        for line in (_PROC / pid / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def session_usage(session_id: int) -> SessionUsage | None:
    """CPU-seconds and peak RSS of the processes in session ``session_id``; None where
    ``/proc`` is not there or no process of the session is alive."""
    if not _PROC.is_dir():
        return None
    ticks, peak, count = 0, 0, 0
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        # after "pid (comm)": [0] state, [3] session, [11..14] utime stime cutime cstime
        if fields is None or len(fields) < 15 or int(fields[3]) != session_id:
            continue
        ticks += sum(int(v) for v in fields[11:15])
        peak += _hwm_bytes(entry.name)
        count += 1
    if not count:
        return None
    return SessionUsage(ticks / _TICKS, peak, count)
