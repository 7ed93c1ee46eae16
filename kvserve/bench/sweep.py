"""``kvserve bench sweep``: a grid of engine settings x request rates, one server per setting.

For each engine setting (``--max-num-seqs`` x ``--kv-cache-memory`` x ``--kv-policy`` x
``--preemption-mode``) a server is started on a free loopback port (kvserve's own, or any
engine through ``--server-cmd-template``), awaited on ``GET /health``, benchmarked at every
``--request-rates`` value ``--repeat`` times with the same dataset, and stopped. Repeats use
different arrival seeds and are averaged (the spread of the output throughput is kept too).
Writes one JSON per point, ``sweep.csv`` and PNG plots (see :mod:`kvserve.bench.plots`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import os
import shlex
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

from kvserve.bench import plots, proc_cost, serve
from kvserve.engine.arg_utils import field_choices, flag_name

LOOPBACK = "127.0.0.1"  # servers started by the sweep listen here only


@dataclass(frozen=True)
class EngineSetting:
    """One server configuration of the grid; None leaves the engine's default."""

    max_num_seqs: int | None = None
    kv_cache_memory: str | None = None
    kv_policy: str | None = None
    preemption_mode: str | None = None

    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in asdict(self).items() if v is not None]
        return ",".join(parts) or "default"

    def slug(self) -> str:
        """File-name-safe label."""
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in self.label())


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """The grid options, then every ``bench serve`` option (dataset, traffic, report)."""
    g = parser.add_argument_group("sweep")
    g.add_argument("--request-rates", default="inf", help="Comma list, e.g. 1,2,4,inf.")
    g.add_argument("--max-num-seqs", dest="sweep_max_num_seqs", default=None, help="Comma list.")
    g.add_argument("--kv-cache-memory", dest="sweep_kv_cache_memory", default=None)
    g.add_argument("--kv-policy", dest="sweep_kv_policy", default=None, help="preempt,reserve")
    g.add_argument("--preemption-mode", dest="sweep_preemption_mode", default=None)
    g.add_argument("--repeat", type=int, default=1, help="Runs per point, averaged.")
    g.add_argument(
        "--server-cmd-template",
        default=None,
        help="Command for another engine with {model} {host} {port} {max_num_seqs} "
        "{kv_cache_memory} {kv_policy} {preemption_mode} placeholders.",
    )
    g.add_argument("--server-extra-args", default="", help="Appended to kvserve's command.")
    g.add_argument("--server-timeout", type=float, default=600.0, help="Health wait, s.")
    serve.add_serve_args(parser)


def parse_list(spec: str | None, cast: Callable[[str], Any] = str) -> list[Any]:
    """``"4,8,16"`` -> [4, 8, 16]; empty -> [None] (one point at the engine's default)."""
    if not spec:
        return [None]
    return [cast(item.strip()) for item in spec.split(",") if item.strip()]


def engine_grid(args: argparse.Namespace) -> list[EngineSetting]:
    """Every combination of the engine-setting lists, in the order given."""
    for name, allowed in (
        ("sweep_kv_policy", field_choices("kv_policy")),
        ("sweep_preemption_mode", field_choices("preemption_mode")),
    ):
        bad = [v for v in parse_list(getattr(args, name)) if v is not None and v not in allowed]
        if bad:
            raise ValueError(f"--{name[6:].replace('_', '-')}: {bad} not in {list(allowed)}.")
    combos = itertools.product(
        parse_list(args.sweep_max_num_seqs, int),
        parse_list(args.sweep_kv_cache_memory),
        parse_list(args.sweep_kv_policy),
        parse_list(args.sweep_preemption_mode),
    )
    return [EngineSetting(*c) for c in combos]


def free_port() -> int:
    """A free TCP port on the loopback interface (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def server_command(args: argparse.Namespace, setting: EngineSetting, port: int) -> list[str]:
    """kvserve's server command for ``setting``, or the user's template filled in."""
    values = {**asdict(setting), "model": args.model, "host": LOOPBACK, "port": port}
    if args.server_cmd_template:
        fields = {f for _, f, _, _ in string.Formatter().parse(args.server_cmd_template) if f}
        missing = sorted(f for f in fields if values.get(f) is None)
        if missing:
            raise ValueError(f"--server-cmd-template uses {missing} but no value was given.")
        return shlex.split(args.server_cmd_template.format(**values))
    cmd = [sys.executable, "-m", "kvserve.cli", "serve"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--host", LOOPBACK, "--port", str(port)]
    for key in ("max_num_seqs", "kv_cache_memory", "kv_policy", "preemption_mode"):
        value = getattr(setting, key)
        if value is not None:
            cmd += [flag_name(key), str(value)]  # kvserve serve's EngineArgs flag
    return cmd + shlex.split(args.server_extra_args)


class ServerProcess:
    """A server subprocess in its own session, stopped with SIGTERM then SIGKILL."""

    def __init__(self, cmd: Sequence[str], log_path: Path) -> None:
        self.cmd, self.log_path = list(cmd), log_path
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        # A new session makes the server's own children (workers) one group we can stop.
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        """The server's pid, also its session's id (it was started as a session leader)."""
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    def wait_healthy(self, base_url: str, timeout_s: float) -> None:
        """Poll ``GET /health`` until 200; fail early if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not healthy after {timeout_s} s; see {self.log_path}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=grace_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):  # it may have just exited
            os.killpg(self.proc.pid, sig)  # the group we created with start_new_session


def make_point(
    setting: EngineSetting, rate: float, results: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """One grid point: the setting, the rate, repeat-averaged metrics and their runs."""
    point: dict[str, Any] = {**asdict(setting), "request_rate": _rate_value(rate)}
    point["repeats"] = len(results)
    for key in plots.POINT_METRICS:
        values = [r[key] for r in results if isinstance(r.get(key), (int, float))]
        point[key] = float(np.mean(values)) if values else None
    outs = [r["output_throughput"] for r in results if "output_throughput" in r]
    point["output_throughput_std"] = float(np.std(outs)) if len(outs) > 1 else 0.0
    point["runs"] = list(results)
    return point


def server_cost(
    before: proc_cost.SessionUsage | None,
    after: proc_cost.SessionUsage | None,
    results: Sequence[dict[str, Any]],
) -> dict[str, float | None]:
    """The study's cost figures of one point (all its repeats, warm-ups included): the
    server's CPU-seconds, its peak RSS so far, and CPU-seconds per 1,000 output tokens."""
    if before is None or after is None:
        return {"server_cpu_seconds": None, "server_peak_rss_mib": None,
                "server_cpu_s_per_1k_output_tokens": None}  # fmt: skip
    cpu = after.cpu_seconds - before.cpu_seconds
    tokens = sum(int(r.get("total_output_tokens") or 0) for r in results)
    return {
        "server_cpu_seconds": cpu,
        "server_peak_rss_mib": after.peak_rss_bytes / 2**20,
        "server_cpu_s_per_1k_output_tokens": 1000 * cpu / tokens if tokens else None,
    }


def _rate_value(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate


def run_point(
    args: argparse.Namespace, base_url: str, rate: float, samples: list[Any], tokenizer: Any
) -> list[dict[str, Any]]:
    """``--repeat`` benchmarks at one rate against a running server."""
    results = []
    for rep in range(args.repeat):
        run_args = copy.copy(args)
        run_args.base_url, run_args.request_rate = base_url, rate
        run_args.seed = args.seed + rep  # new arrivals per repeat; the dataset stays the same
        run_args.disable_tqdm = True
        results.append(asyncio.run(serve.benchmark(run_args, samples, tokenizer)))
    return results


def run_setting(
    args: argparse.Namespace,
    setting: EngineSetting,
    rates: list[float],
    out_dir: Path,
    samples: list[Any],
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """Start a server for ``setting``, benchmark every rate, stop it; return the points."""
    port = free_port()
    server = ServerProcess(
        server_command(args, setting, port), out_dir / f"server-{setting.slug()}.log"
    )
    points = []
    print(f"[sweep] starting server: {setting.label()} on port {port}")
    server.start()
    try:
        server.wait_healthy(f"http://{LOOPBACK}:{port}", args.server_timeout)
        for rate in rates:
            usage = proc_cost.session_usage(server.pid)
            results = run_point(args, f"http://{LOOPBACK}:{port}", rate, samples, tokenizer)
            point = make_point(setting, rate, results)
            point.update(server_cost(usage, proc_cost.session_usage(server.pid), results))
            name = f"point-{setting.slug()}-rate{_rate_value(rate)}.json"
            serve.save_result(point, out_dir / name)
            point["result_file"] = name
            points.append(point)
            print(
                f"[sweep] {setting.label()} rate={rate}: "
                f"{point['output_throughput']:.2f} output tok/s"
            )
    except Exception as e:  # one broken setting must not cost the rest of a long sweep
        print(f"[sweep] {setting.label()} failed: {e}")
        points.append({**asdict(setting), "request_rate": None, "error": str(e)})
    finally:
        server.stop()
    return points


def run_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Entry point of ``bench sweep``; returns every point (also written to disk)."""
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1.")
    rates = [float(r) for r in parse_list(args.request_rates) if r is not None]
    grid = engine_grid(args)
    out_dir = Path(args.result_dir or f"bench-sweep-{datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    samples, tokenizer = serve.prepare(args)
    points: list[dict[str, Any]] = []
    for setting in grid:
        points += run_setting(args, setting, rates, out_dir, samples, tokenizer)
    measured = [p for p in points if "error" not in p]
    plots.write_csv(points, out_dir / "sweep.csv")
    written = plots.write_plots(measured, out_dir)
    print(f"[sweep] wrote {out_dir / 'sweep.csv'} and {len(written)} plots to {out_dir}")
    return points
