"""Watching the server during ``benchmarks/adversarial_soak.py``: its RSS with and without its
children (the grammar compile zygote and workers), and ``/health`` latency from a separate
process, so the client's own busy event loop (it sends the attacks) cannot slow the probes."""

from __future__ import annotations

import asyncio
import http.client
import time
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1), rounded to 0.1; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, max(0, int(q * len(v) + 0.5) - 1))], 1)


def vm_rss_mib(pid: int, proc: Path = Path("/proc")) -> float | None:
    """VmRSS of ``pid`` in MiB, None once it has exited."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below ``pid`` (children of each of its threads, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list((proc / str(p) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def rss_sample(pid: int, proc: Path = Path("/proc")) -> dict[str, float | None]:
    """{"server": its VmRSS, "total": with every descendant's, "children": how many} MiB."""
    server = vm_rss_mib(pid, proc)
    kids = descendants(pid, proc)
    total = (server or 0.0) + sum(vm_rss_mib(k, proc) or 0.0 for k in kids)
    return {"server": server, "total": total if server is not None else None,
            "children": float(len(kids))}  # fmt: skip


class RssSampler:
    """One sample a second, tagged with the phase the run is in."""

    def __init__(self, pid: int) -> None:
        self.pid, self.phase = pid, "start"
        self.samples: list[dict[str, Any]] = []

    async def run(self) -> None:
        t0 = time.monotonic()
        while True:
            s = await asyncio.to_thread(rss_sample, self.pid)
            self.samples.append({"t": round(time.monotonic() - t0, 1), "phase": self.phase, **s})
            await asyncio.sleep(max(0.0, t0 + len(self.samples) - time.monotonic()))

    def level(self, phase: str) -> dict[str, float]:
        """The median server and total RSS of a phase's samples."""
        return level(self.samples, phase)

    def peak(self) -> dict[str, float]:
        return peak(self.samples)


def level(samples: list[dict[str, Any]], phase: str) -> dict[str, float]:
    got = [s for s in samples if s["phase"] == phase and s["server"] is not None]
    out = {}
    for key in ("server", "total"):
        v = sorted(s[key] for s in got)
        out[key] = round(v[len(v) // 2], 1) if v else float("nan")
    return out


def peak(samples: list[dict[str, Any]]) -> dict[str, float]:
    return {key: round(max((s[key] for s in samples if s[key] is not None), default=float("nan")),
                       1) for key in ("server", "total")}  # fmt: skip


def health_poller(host: str, port: int, interval: float, stop: Any, out: Any) -> None:
    """Run in a child process: GET /health on a new connection every ``interval`` s (as a
    load balancer's probe) until ``stop`` is set; put [(time, ms, status)] on ``out``."""
    samples: list[tuple[float, float, int | str]] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            status: int | str = resp.status
        except (OSError, http.client.HTTPException) as e:
            status = type(e).__name__
        finally:
            conn.close()
        ms = (time.perf_counter() - t0) * 1000
        samples.append((time.time(), round(ms, 2), status))
        time.sleep(max(0.0, interval - ms / 1000))
    out.put(samples)
