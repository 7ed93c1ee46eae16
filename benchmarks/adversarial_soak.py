"""Adversarial soak: issue 28's attacks on a real ``kvserve serve --api-key``, beside innocent
traffic that must not notice them.

Starts the server (built-in model, loopback), runs a few greedy streams alone to record their
tokens, then, all at once and each bounded: the 10,000-tools ``tool_choice: "required"`` and
100,000-member ``enum`` requests, more prompts x n than allowed, ``prompt_logprobs`` 21 (each
owed a fast 400 naming a flag); ``prompt_logprobs`` 20 and ``echo`` + ``logprobs`` 20 on a long
prompt and an n=128 chat stream (owed a 200); 256 MiB of one header offered with and without
the key, 10,000 headers, a few hundred half-sent requests (owed a cut connection); 12
concurrent ~1 MB chats and /tokenize calls of that size; the overload mix of
``overload_soak.py``. Meanwhile the innocent streams loop (every one must equal its solo run
token for token), a separate process polls ``/health`` every 100 ms and the server's RSS (and
its children's: the grammar compile workers) is sampled every second. Prints the checks and
writes a JSON result; exits 1 if any failed:

    python benchmarks/adversarial_soak.py --result-file /tmp/adversarial_soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `benchmarks` importable

from benchmarks import adversarial_probes as probes  # noqa: E402
from benchmarks.adversarial_probes import CHAT, COMPLETIONS, MODEL_NAME, Probe  # noqa: E402
from benchmarks.adversarial_watch import RssSampler, health_poller, percentile  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.overload_soak import (  # noqa: E402
    BURST_MIX,
    GOOD_OUTCOMES,
    Workload,
    free_port,
    scan_log,
    wait_idle,
)
from benchmarks.overload_soak import send as overload_send  # noqa: E402
from kvserve.bench.sweep import ServerProcess  # noqa: E402

API_KEY = "soak-key"
# The innocent requests: greedy, fixed, their token ids returned so equality is exact.
INNOCENT: list[tuple[str, str, dict[str, Any]]] = [
    ("completion", COMPLETIONS, {"prompt": "The three primary colors are"}),
    ("chat", CHAT, {"messages": [{"role": "user", "content": "Name a large city in Europe."}]}),
]


# The attack groups (--only runs some, e.g. to find which one keeps memory).
GROUPS = ("http", "limits", "heavy", "big_chats", "overload")


@dataclass(frozen=True)
class Scale:
    """How hard each attack pushes (``--quick`` shrinks them to prove the script works)."""

    header_flood_mib: int = 256
    many_headers: int = 10_000
    slowloris: int = 300
    big_chats: int = 12
    big_tokenizes: int = 2
    big_chat_bytes: int = 1_000_000
    long_prompt_chars: int = 12_000  # ~3,000 tokens of chatterbot lines
    n_stream: int = 128
    overload_requests: int = 24


QUICK = Scale(header_flood_mib=64, many_headers=2_000, slowloris=60, big_chats=4,
              big_tokenizes=1, big_chat_bytes=1_000_000, long_prompt_chars=3_000, n_stream=32,
              overload_requests=6)  # fmt: skip


@dataclass(frozen=True)
class Thresholds:
    """The issue's bars (flags, so a slower machine can be measured without editing)."""

    peak_growth_mib: float = 1024.0  # peak RSS above the idle server
    kept_mib: float = 100.0  # RSS kept after the run and a settle
    health_p99_ms: float = 100.0


@dataclass
class Measurements:
    """What a run measured, as the checks read it (made-up in tests/bench)."""

    rss_idle: dict[str, float]  # {"server": MiB, "total": MiB} idle, after the warm-up
    rss_peak: dict[str, float]
    rss_after: dict[str, float]  # after the run, idle again and settled
    health_ms: list[float]  # every /health poll's latency
    health_status: dict[str, int]  # status (or exception name) -> polls
    innocent: list[dict[str, Any]]  # {"name", "same": bool, ...} per innocent stream
    probes: list[Probe]
    overload_outcomes: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)  # every HTTP status seen


def evaluate(m: Measurements, t: Thresholds) -> list[tuple[str, bool, str]]:
    """The checks: (name, passed, detail)."""
    out: list[tuple[str, bool, str]] = []
    for proc in ("server", "total"):
        growth = m.rss_peak[proc] - m.rss_idle[proc]
        kept = m.rss_after[proc] - m.rss_idle[proc]
        out.append(
            (
                f"peak RSS ({proc}) <= idle + {t.peak_growth_mib:.0f} MiB",
                growth <= t.peak_growth_mib,
                f"idle {m.rss_idle[proc]:.0f}, peak {m.rss_peak[proc]:.0f} ({growth:+.0f})",
            )
        )
        out.append((f"RSS kept after the run ({proc}) <= {t.kept_mib:.0f} MiB", kept <= t.kept_mib,
                    f"after {m.rss_after[proc]:.0f} ({kept:+.0f})"))  # fmt: skip
    p99 = percentile(m.health_ms, 0.99)
    fast = p99 is not None and p99 < t.health_p99_ms
    out.append((f"/health p99 < {t.health_p99_ms:.0f} ms", fast,
                f"p99 {p99} ms, max {max(m.health_ms, default=None)} ms, "
                f"{len(m.health_ms)} polls"))  # fmt: skip
    bad_health = {k: v for k, v in m.health_status.items() if k != "200"}
    out.append(("/health 200 throughout", not bad_health and bool(m.health_status),
                str(m.health_status)))  # fmt: skip
    differ = [r["name"] for r in m.innocent if not r["same"]]
    out.append(("every innocent stream identical to its solo run", bool(m.innocent) and not differ,
                f"{len(m.innocent) - len(differ)}/{len(m.innocent)} identical"))  # fmt: skip
    failed = [f"{p.name}: {p.status} {p.detail[:120]}" for p in m.probes if not p.ok]
    out.append(
        (
            "every attack got the answer owed (400 naming a flag, 200, 413, a cut connection)",
            not failed,
            "; ".join(failed[:5]) or f"{len(m.probes)} probes",
        )
    )
    five = {s: n for s, n in m.statuses.items() if s.isdigit() and int(s) >= 500}
    cap = sum(p.conn_cap_503 for p in m.probes)
    out.append(("zero 5xx (a --max-connections 503 counted apart)", not five,
                f"5xx {five}; connection-cap 503s {cap}"))  # fmt: skip
    bad_mix = {k: v for k, v in m.overload_outcomes.items() if k not in GOOD_OUTCOMES}
    out.append(("the overload mix answered as in overload_soak.py", not bad_mix,
                str(m.overload_outcomes)))  # fmt: skip
    return out


def tally(m: Measurements) -> dict[str, int]:
    """Every HTTP status seen by probes, innocent streams and /health, a conn-cap 503 apart."""
    c: Counter[str] = Counter()
    for p in m.probes:
        c["503_connection_cap" if p.conn_cap_503 else str(p.status)] += 1
    for r in m.innocent:
        c[str(r["status"])] += 1
    for k, v in m.health_status.items():
        c[k] += v
    for k, v in m.statuses.items():
        c[k] += v
    return dict(c)


# -- innocent traffic ---------------------------------------------------------------------------
async def innocent_stream(
    session: aiohttp.ClientSession, base: str, path: str, extra: dict[str, Any], max_tokens: int
) -> tuple[int | str, list[int], str]:
    """One greedy stream: (status, token ids, text)."""
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "return_token_ids": True, "ignore_eos": True, **extra}  # fmt: skip
    ids: list[int] = []
    text: list[str] = []
    try:
        async with session.post(base + path, json=body) as r:
            if r.status != 200:
                return r.status, [], (await r.read())[:200].decode(errors="replace")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices") or []:
                    ids += c.get("token_ids") or []
                    text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return type(e).__name__, ids, "".join(text)
    return 200, ids, "".join(text)


async def innocent_loop(
    session: aiohttp.ClientSession, base: str, solo: dict[str, list[int]], args: argparse.Namespace,
    stop: asyncio.Event,
) -> list[dict[str, Any]]:  # fmt: skip
    """Re-run every innocent stream until ``stop`` (at least once each, in parallel)."""
    runs: list[dict[str, Any]] = []

    async def one(name: str, path: str, extra: dict[str, Any]) -> None:
        while True:
            t0 = time.perf_counter()
            status, ids, text = await innocent_stream(session, base, path, extra, args.max_tokens)
            runs.append(
                {
                    "name": name,
                    "status": status,
                    "same": status == 200 and ids == solo[name],
                    "tokens": len(ids),
                    "seconds": round(time.perf_counter() - t0, 2),
                    **({} if ids == solo[name] else {"ids": ids, "text": text[:300]}),
                }
            )
            if stop.is_set():  # fmt: skip
                return

    await asyncio.gather(*(one(*x) for x in INNOCENT))
    return runs


# -- the run ------------------------------------------------------------------------------------
async def attacks(
    session: aiohttp.ClientSession, base: str, port: int, scale: Scale, args: argparse.Namespace
) -> tuple[list[Probe], dict[str, int]]:
    """The HTTP-layer attacks run beside the request attacks, which go in three waves."""
    workload = Workload(args.seed)
    long_prompt = "Summarize these lines.\n" + probes.big_text(
        workload.prompts, scale.long_prompt_chars
    )
    host, flood = "127.0.0.1", scale.header_flood_mib << 20
    groups = set(args.only.split(","))

    async def http_layer() -> list[Probe]:
        *single, slow = await asyncio.gather(
            asyncio.to_thread(probes.header_flood, host, port, flood, API_KEY, 60.0),
            asyncio.to_thread(probes.header_flood, host, port, flood, None, 60.0),
            asyncio.to_thread(probes.header_count, host, port, scale.many_headers, API_KEY),
            probes.slowloris(host, port, scale.slowloris, args.header_read_timeout + 15),
        )
        return [*single, *slow]

    async def requests() -> tuple[list[Probe], dict[str, int]]:
        # The cheap refusals and the heavy valid requests at once, then the large chats, then
        # the overload mix (so each wave's memory shows in the RSS samples).
        limits = [p for p in probes.limit_probes(long_prompt)
                  if ("heavy" if p[3] == 200 else "limits") in groups]  # fmt: skip
        waves = [probes.expect(session, base, *p) for p in limits]
        if "heavy" in groups:
            waves.append(probes.n_stream(session, base, scale.n_stream))
        out = list(await asyncio.gather(*waves))
        if "big_chats" in groups:
            text = probes.big_text(workload.prompts, scale.big_chat_bytes)
            out += await probes.big_chats(session, base, text, scale.big_chats, scale.big_tokenizes)
        cap = asyncio.Semaphore(8)

        async def mixed() -> str:
            async with cap:
                return (await overload_send(session, base, workload.draw(BURST_MIX))).outcome

        count = scale.overload_requests if "overload" in groups else 0
        outcomes = await asyncio.gather(*(mixed() for _ in range(count)))
        return out, dict(Counter(outcomes))

    http, (reqs, mix) = await asyncio.gather(
        http_layer() if "http" in groups else asyncio.sleep(0, []), requests()
    )
    return [*http, *reqs], mix


async def soak(args: argparse.Namespace, pid: int, port: int) -> dict[str, Any]:
    """Warm-up and solo runs, the idle RSS, the attacks beside innocent loops, the settle."""
    base, scale = f"http://127.0.0.1:{port}", QUICK if args.quick else Scale()
    sampler = RssSampler(pid)
    sampler_task = asyncio.create_task(sampler.run())
    stop_health = mp.get_context("fork").Event()
    queue: Any = mp.get_context("fork").Queue()
    poller = mp.get_context("fork").Process(
        target=health_poller, args=("127.0.0.1", port, 0.1, stop_health, queue), daemon=True
    )
    poller.start()  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(
        timeout=timeout,
        headers=headers,
        read_bufsize=1 << 20,
        connector=aiohttp.TCPConnector(limit=256),
    ) as session:
        # Solo runs, twice (the second is what counts), and one small grammar so the compile
        # workers are part of the idle server, not of what the attack grows.
        solo: dict[str, list[int]] = {}
        solo_s: dict[str, float] = {}
        for _ in range(2):
            for name, path, extra in INNOCENT:
                t = time.perf_counter()
                status, solo[name], _ = await innocent_stream(session, base, path, extra,
                                                              args.max_tokens)  # fmt: skip
                assert status == 200, f"solo {name}: {status}"
                solo_s[name] = round(time.perf_counter() - t, 2)
        warm = [await probes.expect(session, base, "warm_grammar", CHAT, {"model": MODEL_NAME,
            "messages": [{"role": "user", "content": "yes?"}], "max_tokens": 2,
            "guided_choice": ["yes", "no"]}, 200)]  # fmt: skip
        # and one long prompt, as any server meets: its prefill buffers are part of idle too
        long_prompt = probes.big_text(Workload(args.seed).prompts, Scale().long_prompt_chars)
        warm.append(await probes.expect(session, base, "warm_long", COMPLETIONS, {
            "model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 1}, 200))  # fmt: skip
        assert all(p.ok for p in warm), f"warm-up: {warm}"
        sampler.phase = "idle"
        await asyncio.sleep(args.settle_seconds)
        found: list[Probe] = []
        innocent: list[dict[str, Any]] = []
        mix: Counter[str] = Counter()
        attack_s: list[float] = []
        idle = True
        for r in range(args.rounds):  # a second round tells a leak from a high-water mark
            sampler.phase, stop, t0 = "attack", asyncio.Event(), time.monotonic()
            loop = asyncio.create_task(innocent_loop(session, base, solo, args, stop))
            got, outcomes = await attacks(session, base, port, scale, args)
            stop.set()
            innocent += await loop
            found += got
            mix.update(outcomes)
            attack_s.append(round(time.monotonic() - t0, 1))
            print(f"round {r + 1}: attacks done in {attack_s[-1]:.0f} s", flush=True)
            sampler.phase = "drain"
            idle = (await wait_idle(session, base, 60.0))[2] and idle
            sampler.phase = "settle"
            await asyncio.sleep(args.settle_seconds)
            sampler.phase = f"after{r}"
            await asyncio.sleep(3.0)
    stop_health.set()
    health = queue.get(timeout=30)
    poller.join(10)
    sampler_task.cancel()
    m = Measurements(
        rss_idle=sampler.level("idle"), rss_peak=sampler.peak(),
        rss_after=sampler.level(f"after{args.rounds - 1}"),
        health_ms=[h[1] for h in health], health_status=dict(Counter(str(h[2]) for h in health)),
        innocent=innocent, probes=found, overload_outcomes=dict(mix))  # fmt: skip
    after = [sampler.level(f"after{r}") for r in range(args.rounds)]
    return {"measurements": m, "attack_seconds": attack_s, "idle_reached": idle,
            "rss_after_each_round": after,
            "rss_samples": sampler.samples, "solo": solo, "solo_seconds": solo_s,
            "scale": asdict(scale)}  # fmt: skip


# -- report and main ----------------------------------------------------------------------------
def probe_table(found: list[Probe]) -> list[dict[str, Any]]:
    """One row per attack kind: count, statuses, ok count, slowest seconds, a detail."""
    rows: dict[str, dict[str, Any]] = {}
    for p in found:
        r = rows.setdefault(p.name, {"name": p.name, "count": 0, "ok": 0, "statuses": Counter(),
                                     "max_s": 0.0, "detail": p.detail[:160]})  # fmt: skip
        r["count"] += 1
        r["ok"] += p.ok
        r["statuses"][str(p.status)] += 1
        r["max_s"] = round(max(r["max_s"], p.seconds), 2)
    return [{**r, "statuses": dict(r["statuses"])} for r in rows.values()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model-dir", default=None, help="model folder (default: built-in SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype")
    ap.add_argument("--server-threads", type=int, default=1, help="torch / OpenMP threads")
    ap.add_argument("--header-read-timeout", type=float, default=10.0, help="the server's")
    ap.add_argument("--server-extra-args", default="", help="more `kvserve serve` flags")
    ap.add_argument("--quick", action="store_true", help="smaller attacks (prove it works)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"attack groups, of {GROUPS}")
    ap.add_argument("--rounds", type=int, default=1, help="attack rounds (RSS after each)")
    ap.add_argument("--max-tokens", type=int, default=24, help="per innocent stream")
    ap.add_argument("--settle-seconds", type=float, default=5.0, help="before RSS is read")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per request, s")
    ap.add_argument("--peak-growth-mib", type=float, default=Thresholds.peak_growth_mib)
    ap.add_argument("--kept-mib", type=float, default=Thresholds.kept_mib)
    ap.add_argument("--health-p99-ms", type=float, default=Thresholds.health_p99_ms)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", type=Path, default=None)
    ap.add_argument("--server-log", type=Path, default=None, help="default: a temp file")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(GROUPS)
    if unknown:
        ap.error(f"--only: unknown groups {sorted(unknown)}; choose from {GROUPS}")
    return args


def server_cmd(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve"]
    cmd += [args.model_dir] if args.model_dir else []  # none: the built-in SmolLM2
    cmd += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--api-key", API_KEY, "--dtype", args.dtype, "--num-threads", str(args.server_threads)]
    cmd += ["--header-read-timeout", str(args.header_read_timeout)]
    return cmd + shlex.split(args.server_extra_args)


def report(doc: dict[str, Any]) -> None:
    print("\n| attack | count | ok | statuses | slowest s | detail |\n|---|---|---|---|---|---|")
    for r in doc["probes"]:
        print(f"| {r['name']} | {r['count']} | {r['ok']} | {r['statuses']} | {r['max_s']} | "
              f"{r['detail'][:80]} |")  # fmt: skip
    print(f"\nstatuses {doc['statuses']}\nhealth latency ms {doc['health_latency_ms']}")
    print(f"innocent streams: solo s {doc['solo_seconds']}, during s {doc['innocent_seconds']}")
    print(
        f"RSS MiB idle {doc['rss']['idle']}, peak {doc['rss']['peak']}, after {doc['rss']['after']}"
    )
    print(f"RSS MiB after each round: {doc['rss_after_each_round']}")
    for name, ok, detail in doc["checks"]:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info()
    log = args.server_log or Path(tempfile.gettempdir()) / f"adversarial_soak_{os.getpid()}.log"
    port = free_port()
    cmd = server_cmd(args, port)
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # as overload_soak.py
    server = ServerProcess(cmd, log)
    server.start()
    assert server.proc is not None
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", 600)
        print(f"server healthy (log: {log})", flush=True)
        run = asyncio.run(soak(args, server.proc.pid, port))
        alive = server.proc.poll() is None
    finally:
        server.stop()
    m: Measurements = run.pop("measurements")
    m.statuses = tally(m)
    checks = evaluate(m, Thresholds(args.peak_growth_mib, args.kept_mib, args.health_p99_ms))
    checks.append(
        (
            "server alive after the attacks, exits 0 on SIGTERM",
            alive and server.proc.returncode == 0,
            f"exit {server.proc.returncode}",
        )
    )
    log_scan = scan_log(log)
    checks.append(("no traceback in the server log", log_scan["tracebacks"] == 0,
                   f"{log_scan['tracebacks']} tracebacks"))  # fmt: skip
    info["load_average_after"] = list(os.getloadavg())
    doc = {"command": shlex.join(["python", *sys.argv]), "server_command": shlex.join(cmd[1:]),
           "machine": info, "config": {k: str(v) for k, v in vars(args).items()}, **run,
           "probes": probe_table(m.probes), "statuses": m.statuses,
           "health_latency_ms": {q: percentile(m.health_ms, v) for q, v in
                                 (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
           "health_status": m.health_status, "overload_outcomes": m.overload_outcomes,
           "rss": {"idle": m.rss_idle, "peak": m.rss_peak, "after": m.rss_after},
           "innocent_seconds": {q: percentile([r["seconds"] for r in m.innocent], v)
                                for q, v in (("p50", 0.5), ("max", 1.0))},
           "innocent": m.innocent, "server_log": log_scan, "checks": checks}  # fmt: skip
    report(doc)
    if args.result_file:
        args.result_file.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"result: {args.result_file}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
