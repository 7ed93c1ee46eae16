"""A dead tensor-parallel rank stops ``kvserve serve`` (issue 28, finding 4).

vLLM's API server exits when its engine dies, so that systemd, Kubernetes or Ray restart it;
kvserve does the same: a worker killed while the server is idle is seen by the executor's
monitor at once, ``/health`` turns 503 and the process exits with code 1 within 5 s; one
killed during a stream ends that stream with an error event and ``[DONE]``, then the process
exits with code 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.executor.test_tensor_parallel import spawned_children
from tests.server.conftest import Server, start_server

# The figure: a killed idle rank makes the server exit within 5 s.
IDLE_EXIT_S = 5.0
# After a death mid-stream, rank 0 may sit in a collective with the dead rank until the
# executor terminates it (SHUTDOWN_TIMEOUT_S = 10): generous, the point is that it exits.
STREAM_EXIT_S = 60.0


def start_tp2(model: Path, log: Path) -> Server:
    return start_server(
        [str(model), "--tensor-parallel-size", "2", "--dtype", "float32",
         "--num-kv-blocks", "200"],
        log,
    )  # fmt: skip


def workers(pid: int) -> list[int]:
    """The server's multiprocessing-spawned worker processes, by rank (their pids)."""
    return sorted(spawned_children(pid))


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (one not reaped yet has exited all the same)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def health_until_exit(srv: Server, limit: float) -> list[int | str]:
    """/health codes ("closed": no connection) until the process exits or ``limit`` s pass."""
    seen: list[int | str] = []
    deadline = time.monotonic() + limit
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
        except httpx.TransportError:
            seen.append("closed")
        time.sleep(0.05)
    return seen


@pytest.mark.slow
def test_a_rank_killed_while_idle_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_tp2(tiny_model_dir, tmp_path / "server.log")
    try:
        ranks = workers(srv.proc.pid)
        assert len(ranks) == 2
        time.sleep(1.0)  # idle: nothing has run since start-up
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        seen = health_until_exit(srv, IDLE_EXIT_S + 5)
        rc = srv.proc.wait(1)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert rc == 1, log[-3000:]
    assert elapsed < IDLE_EXIT_S, (elapsed, seen)
    # Never healthy again once the first non-200 answer came; 503 or a closed socket after.
    first_down = next((i for i, c in enumerate(seen) if c != 200), len(seen))
    assert set(seen[first_down:]) <= {503, "closed"}, seen
    assert first_down <= 2, seen  # the monitor saw it at once (each poll takes >= 50 ms)
    assert f"worker process rank 1 (pid {ranks[1]}) died" in log
    assert "exiting with code 1 so that a supervisor restarts the server" in log
    assert not any(running(p) for p in ranks)  # rank 0 stopped too


@pytest.mark.slow
def test_a_rank_killed_during_a_stream_fails_it_then_exits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    srv = start_tp2(tiny_model_dir, tmp_path / "server.log")
    try:
        ranks = workers(srv.proc.pid)
        # 900 tokens: within the tiny model's 1024 positions, far more than the kill needs
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(ranks[1], signal.SIGKILL)  # mid-stream
        rc = srv.proc.wait(STREAM_EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit:\n{srv.log.read_text()[-3000:]}")
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert rc == 1, log[-3000:]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert f"rank 1 (pid {ranks[1]}) died" in error["message"], error
    tokens = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 3 <= len(tokens) < 900  # it had streamed, and ended early
    assert "exiting with code 1 so that a supervisor restarts the server" in log
