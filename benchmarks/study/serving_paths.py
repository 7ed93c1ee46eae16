"""Experiment 10: one engine, four ways in (issue 37, item 3: engine-server combinations).

The same kvserve engine (built-in model, one torch thread, the same KV cache and batch) serves
the same requests four ways, each at the same arrival times:

* ``engine``: in process, fed by the study's driver (no server at all: the ceiling);
* ``http``: ``kvserve serve``, OpenAI ``/v1/completions`` streamed as SSE;
* ``grpc``: the same server's ``--grpc-port``, ``GenerateStream`` (protobuf over HTTP/2);
* ``ray``: ``kvserve serve --ray``: a local Ray cluster, Serve's HTTP proxy, kvserve's ingress
  deployment and one engine replica (``/v1/completions`` again).

Every path takes the prompt as text and tokenizes it the same way (the engine's processor), so
greedy decoding with ``ignore_eos`` makes the same tokens on each: the differences are what
the path costs. Server points carry the server session's CPU-seconds and peak RSS (Ray's
raylet, GCS and actors are in it); the engine point's CPU figure is the study process's own
(engine plus driver, ``time.process_time``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.study import engines, output
from benchmarks.study.driver import DriverRequest, warm_up
from benchmarks.study.experiments import (
    INF,
    SLO,
    Outcome,
    RunContext,
    engine_point,
    kv_engine_kwargs,
    kv_fields,
    make_engine,
    model_folder,
    options_of,
    server_argv,
    server_points,
    sweep_args,
)
from benchmarks.study.workloads import chatterbot_samples, model_size
from kvserve.bench import sweep
from kvserve.bench.datasets import SampleRequest
from kvserve.sampling_params import SamplingParams

PATHS = ("http", "grpc", "ray")  # the server paths; "engine" is always measured as well
# The ``kvserve serve`` flags each path adds (besides the engine flags every server gets).
SERVER_FLAGS = {"http": "", "grpc": "--grpc-port {grpc_port}", "ray": "--ray"}


@dataclass(frozen=True)
class Exp10Config:
    request_rates: tuple[float, ...] = (8.0, 16.0, 32.0, INF)
    num_prompts: int = 96
    max_output_len: int = 64  # reference-answer lengths capped here (ignore_eos)
    max_num_seqs: int = 16
    kv_cache: str = "256blocks"  # roomy: no preemption, only the path varies
    paths: tuple[str, ...] = PATHS


EXP10_QUICK = Exp10Config((INF,), 6, 8, 4, "64blocks")


def completion_requests(samples: list[SampleRequest]) -> list[DriverRequest]:
    """The samples as ``/v1/completions`` sends them: the prompt text, greedy, exactly the
    sample's expected length."""
    out = []
    for s in samples:
        params = SamplingParams(temperature=0.0, max_tokens=s.expected_output_len, ignore_eos=True)
        out.append(DriverRequest(s.prompt, params, s.expected_output_len))
    return out


def path_flags(path: str, grpc_port: int) -> tuple[list[str], str]:
    """(the lab's extra ``bench serve`` flags, the extra ``kvserve serve`` flags) of a path."""
    if path not in SERVER_FLAGS:
        raise ValueError(f"unknown serving path {path!r}; expected one of {PATHS}")
    if path == "grpc":
        lab = ["--backend", "grpc", "--grpc-port", str(grpc_port)]
    else:
        lab = ["--backend", "openai"]  # /v1/completions, also through Ray Serve's ingress
    return lab, SERVER_FLAGS[path].format(grpc_port=grpc_port)


def engine_points(ctx: RunContext, cfg: Exp10Config) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The in-process engine at every rate, ``ctx.repeats`` times; also its KV fields."""
    engine = make_engine(ctx.model, max_num_seqs=cfg.max_num_seqs, **kv_engine_kwargs(cfg.kv_cache))
    samples = chatterbot_samples(engine.tokenizer, cfg.num_prompts, ctx.seed, cfg.max_output_len)
    reqs = completion_requests(samples)
    warm_up(engine, reqs[0].prompt)
    kv = kv_fields(engine)
    points = []
    for rep in range(ctx.repeats):
        for rate in cfg.request_rates:
            cpu = time.process_time()
            p = engine_point(engine, reqs, rate, ctx.seed)
            cpu = time.process_time() - cpu
            tokens = p.get("total_output_tokens") or 0
            p.update(serving_path="engine", engine="kvserve", repeat=rep,
                     max_num_seqs=cfg.max_num_seqs, server_cpu_seconds=cpu,
                     server_cpu_s_per_1k_output_tokens=1000 * cpu / tokens if tokens else None,
                     **kv)  # fmt: skip
            print(f"[exp10] engine rate={rate}: {p['output_throughput']:.1f} out tok/s", flush=True)
            points.append(p)
    return points, kv


def exp10(ctx: RunContext) -> Outcome:
    """Chatterbot prompts as completions (reference lengths, ignore_eos, greedy) through the
    engine alone, its HTTP server, its gRPC server and Ray Serve; paths alternate per repeat,
    each with a fresh server."""
    cfg = EXP10_QUICK if ctx.quick else Exp10Config()
    points, kv = engine_points(ctx, cfg)
    dataset = [
        "--dataset-name", "chatterbot", "--chatterbot-max-output-len", str(cfg.max_output_len),
        "--num-prompts", str(cfg.num_prompts), "--ignore-eos", "--temperature", "0", *SLO,
        "--server-timeout", "600",
    ]  # fmt: skip
    base = sweep_args(server_argv(ctx, dataset, cfg.kv_cache))
    setting = sweep.EngineSetting(max_num_seqs=cfg.max_num_seqs)

    def once(path: str, rep: int) -> list[dict[str, Any]]:
        lab, server = path_flags(path, sweep.free_port())
        args = sweep_args([*server_argv(ctx, [*dataset, *lab], cfg.kv_cache, server)])
        work = ctx.work_dir / f"exp10-{path}-{rep}"
        served = server_points(args, [setting], cfg.request_rates, work)
        return [{**p, "serving_path": path} for p in served]

    for rep in range(ctx.repeats):
        for path in engines.engine_order(cfg.paths, rep):
            points += [{**p, "engine": "kvserve", "repeat": rep, **kv} for p in once(path, rep)]
    order = {name: i for i, name in enumerate(("engine", *cfg.paths))}
    points.sort(key=lambda p: (p["request_rate"], order[p["serving_path"]], p["repeat"]))
    return Outcome(
        "exp10",
        "One engine, four ways in: in process, HTTP, gRPC and Ray Serve (chatterbot completions)",
        points,
        {
            "config": asdict(cfg),
            "server_flags": {p: SERVER_FLAGS[p] for p in cfg.paths},
            "model_size": model_size(model_folder(ctx.model)),
        },
        {"lab_settings": options_of(base)},
    )


def plot(doc: dict[str, Any], out: Path) -> list[Path]:
    """Throughput, median TTFT and CPU-seconds per 1,000 tokens against the rate, a line per
    path."""
    from benchmarks.study.figures import rate_panels

    pts, cfg = doc["points"], doc["settings"]["config"]

    def path(p: dict[str, Any]) -> str:
        return str(p["serving_path"])

    panels = rate_panels(
        pts,
        path,
        (
            ("output_throughput", "output tok/s", "throughput"),
            ("median_ttft_ms", "median TTFT (ms)", "time to first token"),
            ("server_cpu_s_per_1k_output_tokens", "CPU s / 1k output tokens", "CPU cost"),
        ),
    )
    main = output.panels_plot(
        panels,
        out / "exp10.png",
        f"Exp 10: {cfg['num_prompts']} chatterbot completions, max_num_seqs "
        f"{cfg['max_num_seqs']}, one engine thread",
        width=4.2,
    )
    return [main]
