"""Overload soak: a real ``kvserve serve`` under a mixed burst at 10x its capacity.

Starts a server with a bounded queue, measures how many requests/s it finishes for a mixed
workload at a modest concurrency (this also warms it up), then sends the same mix plus
mid-stream disconnects, abandoned requests and invalid requests at 10x that rate for about a
minute. Every request must be answered: a result (200; a stream ends with ``[DONE]``), a 429
with ``Retry-After``, or the 400 an invalid request deserves; never a connection error, a
timeout or a 5xx. Afterwards the server must go idle with no KV block in use and stay healthy.
Samples the server's RSS every second. Prints a summary and writes a JSON result; exits 1 if
any check failed:

    python benchmarks/overload_soak.py --result-file /tmp/overload_soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.datasets import load_chatterbot_conversations
from kvserve.bench.sweep import ServerProcess

MODEL_NAME = "soak"  # the served name, so requests and /metrics labels do not depend on the model
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Modest lengths keep the run bounded on a shared 2-core box: what is admitted at the end of the
# burst (up to --max-num-seqs running + --max-queued-requests waiting) must drain in about a minute.
MAX_TOKENS_CHOICES = (4, 8, 16, 32, 64, 128)
LONG_PROMPT_CHARS = 3000  # ~700 tokens of chatterbot lines: a few fill --max-num-queued-tokens
# All zero once the server is idle; a KV block still in use after that is a leak.
IDLE_GAUGES = (
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc",
)
# Outcomes that count as correctly answered; anything else is a failure.
GOOD_OUTCOMES = ("ok", "disconnected", "abandoned", "rejected_429", "bad_request_400")


@dataclass
class Job:
    """One request to send and what the client does with it."""

    kind: str
    path: str
    body: dict[str, Any] | str  # a str is sent verbatim (malformed JSON)
    expect_400: bool = False
    disconnect_after: int | None = None  # close the stream after this many data events
    abandon_after: float | None = None  # give up on a non-streaming request after this many s

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


@dataclass
class Result:
    kind: str
    outcome: str
    status: int | None
    latency_s: float
    detail: str = ""
    body: str = ""  # the request body, kept for failures only


# Each should get a 400 (bad field values, an impossible length, malformed JSON...).
INVALID_BODIES: list[tuple[str, dict[str, Any] | str]] = [
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}),
    (COMPLETIONS, {"prompt": "Hi", "n": 0}),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1_000_000}),
    (COMPLETIONS, {"prompt": "Hi", "n": 100_000}),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"99999999": 5}}),  # outside the vocabulary
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}),
    (COMPLETIONS, {"prompt": [10**9]}),
    (COMPLETIONS, '{"prompt": "Hi", "max_tokens": '),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -3, "stream": True}),
    (CHAT, {"messages": "Hi"}),
]


# Request kind -> weight in the burst. The capacity phase uses only the kinds that run to the end.
BURST_MIX = {
    "completion": 16, "completion_stream": 16, "chat": 13, "chat_stream": 13,
    "long_completion": 5, "long_chat_stream": 5, "multi_n": 6, "multi_n_stream": 6,
    "disconnect_stream": 9, "abandon": 3, "invalid": 8,
}  # fmt: skip
COMPLETING = ("completion", "completion_stream", "chat", "chat_stream", "long_completion",
              "long_chat_stream", "multi_n", "multi_n_stream")  # fmt: skip


class Workload:
    """Draws mixed requests from chatterbot prompts with a seeded RNG."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prompts = [p for p, _ in load_chatterbot_conversations()]

    def long_prompt(self) -> str:
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < LONG_PROMPT_CHARS:
            parts.append(self.rng.choice(self.prompts))
        return "Answer the last question.\n" + "\n".join(parts)

    def sampling(self, n: int = 1) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"model": MODEL_NAME, "n": n, "seed": rng.randrange(1 << 30)}
        body["max_tokens"] = rng.choice(MAX_TOKENS_CHOICES)
        body["temperature"] = rng.choice((0.0, 0.7, 1.0))
        # Some run to max_tokens whatever the model says, so long outputs really occur.
        body["ignore_eos"] = rng.random() < 0.3
        return body

    def job(self, kind: str) -> Job:
        rng = self.rng
        if kind == "invalid":
            path, body = rng.choice(INVALID_BODIES)
            return Job(kind, path, body if isinstance(body, str) else dict(body), expect_400=True)
        # n > 1 only with short prompts: n x a long prompt could exceed --max-num-queued-tokens
        # on its own, and then every try gets a 429.
        body = self.sampling(rng.randint(2, 4) if kind.startswith("multi_n") else 1)
        prompt = self.long_prompt() if kind.startswith("long") else rng.choice(self.prompts)
        # The kind names its endpoint, else (n > 1, disconnects, abandons) either one.
        chat = "chat" in kind or ("completion" not in kind and rng.random() < 0.5)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        job = Job(kind, CHAT if chat else COMPLETIONS, body)
        if kind.endswith("stream"):
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if kind == "disconnect_stream":
            body.update(max_tokens=512, ignore_eos=True)  # would run long unless aborted
            job.disconnect_after = rng.randint(1, 5)
        if kind == "abandon":
            body.update(max_tokens=512, ignore_eos=True)
            job.abandon_after = rng.uniform(0.5, 2.0)
        return job

    def draw(self, kinds: dict[str, int]) -> Job:
        kind = self.rng.choices(list(kinds), weights=list(kinds.values()))[0]
        return self.job(kind)


# -- the client ---------------------------------------------------------------------------------
JSON_HEADERS = {"Content-Type": "application/json"}


async def send(session: aiohttp.ClientSession, base: str, job: Job) -> Result:
    """Send one job and classify how the server answered it."""
    data = job.body if isinstance(job.body, str) else json.dumps(job.body)
    t0 = time.perf_counter()
    try:
        work = _exchange(session, base + job.path, data, job)
        if job.abandon_after is None:
            outcome, status, detail = await work
        else:
            try:
                outcome, status, detail = await asyncio.wait_for(work, job.abandon_after)
            except TimeoutError:  # ours: leaving closes the connection, as a client giving up
                outcome, status, detail = "abandoned", None, ""
    except TimeoutError:  # the session's total timeout: the server did not answer in time
        outcome, status, detail = "timeout", None, ""
    except aiohttp.ClientError as e:
        outcome, status, detail = "connection_error", None, f"{type(e).__name__}: {e}"
    except (ValueError, KeyError) as e:  # a body or SSE event that is not the API's JSON
        outcome, status, detail = "bad_body", None, f"{type(e).__name__}: {e}"
    result = Result(job.kind, outcome, status, time.perf_counter() - t0, detail)
    if outcome not in GOOD_OUTCOMES:
        result.body = data[:2000]
    return result


async def _exchange(
    session: aiohttp.ClientSession, url: str, data: str, job: Job
) -> tuple[str, int, str]:
    async with session.post(url, data=data, headers=JSON_HEADERS) as resp:
        status = resp.status
        if status == 429:
            await resp.read()
            if not resp.headers.get("Retry-After", "").isdigit():
                return "429_without_retry_after", status, str(dict(resp.headers))
            return "rejected_429", status, ""
        if job.expect_400 or status != 200:
            text = (await resp.text())[:500]
            if job.expect_400 and status == 400:
                return "bad_request_400", status, ""
            return f"http_{status}", status, text
        if job.stream:
            outcome, detail = await _read_stream(resp, job)
            return outcome, status, detail
        payload = await resp.json()
        n = job.body["n"] if isinstance(job.body, dict) else 1
        if len(payload.get("choices") or []) != n:
            return "bad_body", status, json.dumps(payload)[:500]
        return "ok", status, ""


async def _read_stream(resp: aiohttp.ClientResponse, job: Job) -> tuple[str, str]:
    """Read SSE events to ``[DONE]`` (or close early for a disconnecting client)."""
    events, indexes = 0, set[int]()
    n = job.body["n"] if isinstance(job.body, dict) else 1
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            if indexes != set(range(n)):
                return "bad_stream", f"choice indexes {sorted(indexes)} for n={n}"
            return "ok", ""
        chunk = json.loads(data)
        if "error" in chunk:
            return "stream_error", data.decode()[:500]
        indexes.update(c["index"] for c in chunk.get("choices") or [])
        events += 1
        if job.disconnect_after is not None and events >= job.disconnect_after:
            resp.close()  # drops the connection mid-stream: the server must abort the request
            return "disconnected", ""
    return "stream_cut", f"the stream ended without [DONE] after {events} events"


# -- the phases ---------------------------------------------------------------------------------
async def measure_capacity(
    session: aiohttp.ClientSession, base: str, workload: Workload, concurrency: int, seconds: float
) -> tuple[float, list[Result]]:
    """Requests/s that finish for the completing mix at ``concurrency`` (closed loop).

    One untimed round first: the first batches pay one-off costs (kernel creation, allocator
    growth) that would understate the capacity.
    """
    mix = {k: BURST_MIX[k] for k in COMPLETING}
    results: list[Result] = list(
        await asyncio.gather(*(send(session, base, workload.draw(mix)) for _ in range(concurrency)))
    )
    timed: list[Result] = []
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            timed.append(await send(session, base, workload.draw(mix)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    finished = sum(r.outcome == "ok" for r in timed)
    return finished / (time.monotonic() - t0), results + timed


@dataclass
class BurstStats:
    target_rate: float
    sent: int = 0
    send_seconds: float = 0.0
    total_seconds: float = 0.0
    client_cap_waits: int = 0  # arrivals delayed because the client's concurrency cap was full
    hung: int = 0


async def run_burst(
    session: aiohttp.ClientSession,
    base: str,
    workload: Workload,
    args: argparse.Namespace,
    rate: float,
) -> tuple[list[Result], BurstStats]:
    """Poisson arrivals at ``rate`` for ``--burst-seconds`` or ``--max-requests``, whichever
    comes first, with at most ``--client-concurrency`` requests open at once."""
    stats = BurstStats(target_rate=rate)
    results: list[Result] = []
    cap = asyncio.Semaphore(args.client_concurrency)
    tasks: list[asyncio.Task[None]] = []

    async def one(job: Job) -> None:
        try:
            results.append(await send(session, base, job))
        finally:
            cap.release()

    t0 = next_at = time.monotonic()
    while stats.sent < args.max_requests:
        next_at += workload.rng.expovariate(rate)
        if next_at - t0 > args.burst_seconds:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        stats.client_cap_waits += cap.locked()
        await cap.acquire()
        tasks.append(asyncio.create_task(one(workload.draw(BURST_MIX))))
        stats.sent += 1
    stats.send_seconds = time.monotonic() - t0
    # Every request carries the session's timeout, so this wait only guards the client itself.
    _, pending = await asyncio.wait(tasks, timeout=args.request_timeout + 30)
    for task in pending:
        task.cancel()
    stats.hung = len(pending)
    stats.total_seconds = time.monotonic() - t0
    return results, stats


# -- watching the server ------------------------------------------------------------------------
def rss_mib(pid: int) -> float | None:
    """The process's resident set (VmRSS) in MiB; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return None


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """Sample name -> value of the served model's gauges and counters on /metrics."""
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL_NAME and "le" not in s.labels:
                key = s.name
                if "finished_reason" in s.labels:
                    key += f"{{{s.labels['finished_reason']}}}"
                out[key] = s.value
    return out


async def health(session: aiohttp.ClientSession, base: str) -> int | str:
    try:
        async with session.get(f"{base}/health") as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        return type(e).__name__


@dataclass
class Monitor:
    """Samples the server every second: RSS; every 2 s the queue gauges; every 5 s /health.

    Its own session keeps the samples on time while the load's connections are all busy.
    """

    pid: int
    base: str
    phase: str = "idle"
    samples: list[dict[str, Any]] = field(default_factory=list)
    health_codes: Counter[str] = field(default_factory=Counter)
    peak: Counter[str] = field(default_factory=Counter)  # most running / waiting seen

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0, tick = time.monotonic(), 0
            while True:
                sample: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
                sample.update(phase=self.phase, rss_mib=rss_mib(self.pid))
                if tick % 2 == 0:
                    try:
                        m = await scrape(session, self.base)
                        for name in ("running", "waiting"):
                            value = int(m[f"kvserve:num_requests_{name}"])
                            sample[name] = value
                            self.peak[name] = max(self.peak[name], value)
                        sample["kv_usage"] = round(m["kvserve:kv_cache_usage_perc"], 3)
                    except (aiohttp.ClientError, TimeoutError, KeyError) as e:
                        sample["metrics_error"] = type(e).__name__
                if tick % 5 == 0:
                    self.health_codes[str(await health(session, self.base))] += 1
                self.samples.append(sample)
                tick += 1
                await asyncio.sleep(max(0.0, t0 + tick - time.monotonic()))

    def rss(self, phase: str | None = None) -> list[float]:
        return [
            s["rss_mib"]
            for s in self.samples
            if s["rss_mib"] is not None and (phase is None or s["phase"] == phase)
        ]


async def wait_idle(
    session: aiohttp.ClientSession, base: str, timeout: float
) -> tuple[dict[str, float], float, bool]:
    """Poll /metrics until nothing runs or waits and no KV block is in use.

    Returns the last metrics, the seconds waited and whether the server went idle.
    """
    t0 = time.monotonic()
    while True:
        m = await scrape(session, base)
        idle = all(m[name] == 0 for name in IDLE_GAUGES)
        waited = time.monotonic() - t0
        if idle or waited > timeout:
            return m, waited, idle
        await asyncio.sleep(0.2)


# -- the run ------------------------------------------------------------------------------------
async def soak(args: argparse.Namespace, pid: int, base: str) -> dict[str, Any]:
    """Capacity, burst at ``--overload`` x capacity, then the idle and health checks."""
    workload = Workload(args.seed)
    monitor = Monitor(pid, base)
    monitor_task = asyncio.create_task(monitor.run())
    await asyncio.sleep(1.5)  # an RSS sample of the idle, just-loaded server
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.client_concurrency)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, read_bufsize=1 << 20
    ) as session:
        monitor.phase, t0 = "capacity", time.monotonic()
        capacity, warm = await measure_capacity(
            session, base, workload, args.capacity_concurrency, args.capacity_seconds
        )
        t1 = time.monotonic()
        print(f"capacity: {capacity:.2f} requests/s finished ({t1 - t0:.0f} s)", flush=True)
        monitor.phase = "burst"
        burst, stats = await run_burst(session, base, workload, args, args.overload * capacity)
        monitor.phase = "drain"
        metrics, idle_wait, idle = await wait_idle(session, base, args.idle_timeout)
        monitor.phase = "after"
        await asyncio.sleep(3.0)  # RSS of the idle server after the run
        final_health = await health(session, base)
    monitor_task.cancel()
    return {
        "capacity_rps": capacity,
        "capacity_phase_s": round(t1 - t0, 1),  # with the requests still open at its end
        "capacity_results": warm,
        "burst_results": burst,
        "burst": asdict(stats),
        "idle": {"reached": idle, "waited_s": round(idle_wait, 2), "metrics": metrics},
        "final_health": final_health,
        "monitor": monitor,
    }


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    v = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return round(v[min(len(v) - 1, max(0, int(q * len(v) + 0.5) - 1))], 3)

    return {"count": len(v), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": at(1.0)}


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON-able figures of a run and the list of checks (name, passed, detail)."""
    burst: list[Result] = run["burst_results"]
    every = run["capacity_results"] + burst
    monitor: Monitor = run["monitor"]
    per_kind: dict[str, Counter[str]] = {}
    for r in burst:
        per_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    rss_all, rss_warm = monitor.rss(), monitor.rss("capacity")
    rss_after = monitor.rss("after") or rss_all[-1:]
    rss = {
        "start_mib": round(rss_all[0], 1),
        "after_warmup_mib": round(rss_warm[-1], 1),
        "peak_mib": round(max(rss_all), 1),
        "end_mib": round(rss_after[-1], 1),
    }
    rss["growth_after_warmup_mib"] = round(rss["end_mib"] - rss["after_warmup_mib"], 1)
    failures = [asdict(r) for r in every if r.outcome not in GOOD_OUTCOMES]
    idle_m = run["idle"]["metrics"]
    summary = {
        "capacity_rps": round(run["capacity_rps"], 3),
        "capacity_phase_s": run["capacity_phase_s"],
        "burst": run["burst"],
        "offered_rps": round(run["burst"]["sent"] / max(run["burst"]["send_seconds"], 1e-9), 2),
        "outcomes": dict(Counter(r.outcome for r in burst)),
        "outcomes_per_kind": {k: dict(v) for k, v in sorted(per_kind.items())},
        "capacity_phase_outcomes": dict(Counter(r.outcome for r in run["capacity_results"])),
        "latency_200_s": percentiles([r.latency_s for r in burst if r.outcome == "ok"]),
        "latency_429_s": percentiles([r.latency_s for r in burst if r.outcome == "rejected_429"]),
        "latency_400_s": percentiles(
            [r.latency_s for r in burst if r.outcome == "bad_request_400"]
        ),
        "rss": rss,
        "peak_gauges": dict(monitor.peak),
        "health_during_run": dict(monitor.health_codes),
        "final_health": run["final_health"],
        "idle": run["idle"],
        "failures": failures[:50],
        "num_failures": len(failures),
        "samples": monitor.samples,
    }
    summary["checks"] = checks(summary, args, idle_m)
    return summary


def checks(s: dict[str, Any], args: argparse.Namespace, idle_m: dict[str, float]) -> list[Any]:
    running, waiting = s["peak_gauges"].get("running", 0), s["peak_gauges"].get("waiting", 0)
    bad_health = {k: v for k, v in s["health_during_run"].items() if k != "200"}
    return [
        ("every request answered (200 / 429 / expected 400)", s["num_failures"] == 0,
         f"{s['num_failures']} failures"),
        ("no client task hung", s["burst"]["hung"] == 0, f"{s['burst']['hung']} hung"),
        ("the burst overloaded the server (some 429s)",
         s["outcomes"].get("rejected_429", 0) > 0, f"{s['outcomes'].get('rejected_429', 0)} 429s"),
        ("/health 200 throughout", not bad_health, f"{dict(s['health_during_run'])}"),
        ("/health 200 after", s["final_health"] == 200, str(s["final_health"])),
        ("idle after: no KV block, nothing running or waiting", s["idle"]["reached"],
         f"kv_cache_usage_perc={idle_m.get('kvserve:kv_cache_usage_perc')} "
         f"running={idle_m.get('kvserve:num_requests_running')} "
         f"waiting={idle_m.get('kvserve:num_requests_waiting')}"),
        ("running <= --max-num-seqs", running <= args.max_num_seqs, f"peak {running}"),
        ("waiting <= --max-queued-requests", waiting <= args.max_queued_requests,
         f"peak {waiting} (sampled every 2 s)"),
    ]  # fmt: skip


# -- report ---------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.strip() for ln in lscpu.splitlines() if "Model name" in ln), "unknown")
    return {"cpu": " ".join(model.split()), "cores": os.cpu_count(), "uptime_before": uptime()}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def scan_log(path: Path, context: int = 30) -> dict[str, Any]:
    """Count tracebacks and error lines in the server log; keep the first traceback."""
    lines = path.read_text(errors="replace").splitlines()
    tracebacks = [i for i, ln in enumerate(lines) if ln.startswith("Traceback")]
    errors = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln]
    first = lines[max(0, tracebacks[0] - 5) : tracebacks[0] + context] if tracebacks else []
    return {
        "path": str(path),
        "lines": len(lines),
        "tracebacks": len(tracebacks),
        "error_lines": errors[:20],
        "first_traceback": first,
    }


def print_summary(s: dict[str, Any]) -> None:
    b = s["burst"]
    print(f"\ncapacity {s['capacity_rps']:.2f} req/s (phase {s['capacity_phase_s']:.0f} s)")
    print(
        f"burst: target {b['target_rate']:.1f} req/s, offered {s['offered_rps']:.1f} req/s, "
        f"{b['sent']} requests in {b['send_seconds']:.0f} s, all answered after "
        f"{b['total_seconds']:.0f} s"
    )
    outcomes = sorted({o for v in s["outcomes_per_kind"].values() for o in v})
    print(f"\n| kind | {' | '.join(outcomes)} |")
    print("|---" * (len(outcomes) + 1) + "|")
    for kind, counts in [*s["outcomes_per_kind"].items(), ("total", s["outcomes"])]:
        print(f"| {kind} | {' | '.join(str(counts.get(o, 0)) for o in outcomes)} |")
    print("\n| latency (s) | count | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|")
    for name in ("200", "429", "400"):
        p = s[f"latency_{name}_s"]
        cols = [p.get(k, "-") for k in ("count", "p50", "p90", "p99", "max")]
        print(f"| {name} | {' | '.join(str(c) for c in cols)} |")
    r = s["rss"]
    print(
        f"\nserver RSS MiB: start {r['start_mib']}, after warm-up {r['after_warmup_mib']}, "
        f"peak {r['peak_mib']}, end {r['end_mib']} "
        f"(growth after warm-up {r['growth_after_warmup_mib']:+})"
    )
    idle = {k.split(":")[1]: v for k, v in s["idle"]["metrics"].items() if k in IDLE_GAUGES}
    print(f"peak gauges {s['peak_gauges']}; after {s['idle']['waited_s']} s: {idle}")
    print()
    for name, ok, detail in s["checks"]:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    log = s["server_log"]
    for line in log["error_lines"][:5] + log["first_traceback"][-1:]:
        print(f"  server log: {line[:300]}")
    for f in s["failures"][:10]:
        print(f"  failure: {f['kind']} {f['outcome']} {f['status']} {f['detail'][:200]!r}")
        print(f"    body: {f['body'][:300]}")


# -- main ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve"]
    cmd += [args.model_dir] if args.model_dir else []  # none: the built-in SmolLM2
    cmd += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-queued-requests", str(args.max_queued_requests)]
    cmd += ["--max-num-queued-tokens", str(args.max_num_queued_tokens)]
    # serve sets one torch thread per core unless told, whatever OMP_NUM_THREADS says.
    cmd += ["--num-threads", str(args.server_threads)]
    return cmd + shlex.split(args.server_extra_args)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model-dir", default=None, help="model folder (default: built-in SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (auto: bfloat16)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queued-requests", type=int, default=16)
    ap.add_argument("--max-num-queued-tokens", type=int, default=4096)
    ap.add_argument("--server-threads", type=int, default=1, help="torch / OpenMP threads")
    ap.add_argument("--server-extra-args", default="", help="more `kvserve serve` flags")
    ap.add_argument("--capacity-concurrency", type=int, default=4)
    ap.add_argument("--capacity-seconds", type=float, default=20.0)
    ap.add_argument("--overload", type=float, default=10.0, help="burst rate / capacity")
    ap.add_argument("--burst-seconds", type=float, default=60.0)
    ap.add_argument("--max-requests", type=int, default=3000, help="cap on burst requests")
    ap.add_argument("--client-concurrency", type=int, default=256, help="most open requests")
    ap.add_argument("--request-timeout", type=float, default=180.0, help="per request, s")
    ap.add_argument("--idle-timeout", type=float, default=30.0, help="wait for idle after, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", type=Path, default=None)
    ap.add_argument("--server-log", type=Path, default=None, help="default: a temp file")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    info = machine_info()
    log = args.server_log or Path(tempfile.gettempdir()) / f"overload_soak_{os.getpid()}.log"
    port = free_port()
    cmd = server_cmd(args, port)
    # One OpenMP thread, as tests/server/conftest.py: on a shared 2-core box barriers between
    # two threads stall whenever another process takes a core.
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)
    server = ServerProcess(cmd, log)
    server.start()
    assert server.proc is not None
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        server.wait_healthy(base, 600)
        print(f"server healthy after {time.monotonic() - t0:.0f} s (log: {log})", flush=True)
        run = asyncio.run(soak(args, server.proc.pid, base))
        alive = server.proc.poll() is None
    finally:
        server.stop()
    summary = summarize(run, args)
    pid = server.proc.pid
    summary["checks"].append(("server process alive after the burst", alive, f"pid {pid}"))
    code = server.proc.returncode
    summary["checks"].append(("server exits 0 on SIGTERM", code == 0, f"exit code {code}"))
    summary["server_log"] = scan_log(log)
    tb = summary["server_log"]["tracebacks"]
    summary["checks"].append(("no traceback in the server log", tb == 0, f"{tb} tracebacks"))
    info["uptime_after"] = uptime()
    summary = {
        "command": shlex.join(["python", *sys.argv]),
        "server_command": shlex.join(cmd[1:]),
        "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **summary,
    }
    print_summary(summary)
    print(
        f"\nmachine: {info['cpu']}, {info['cores']} cores\n  before: {info['uptime_before']}"
        f"\n  after:  {info['uptime_after']}"
    )
    if args.result_file:
        args.result_file.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        print(f"result: {args.result_file}")
    return 0 if all(ok for _, ok, _ in summary["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
