"""The second wave's levers under load (issue 37, item 3).

Experiment 7: speculative decoding across request rates. n-gram speculation (prompt lookup)
on a workload whose answers copy from their prompts (benchmarks/spec_decode.py's "grounded"
prompts: rewrite this text without typos, rename a variable in this code), through the HTTP
server at rates from a trickle to all at once, three ways: off, always on, and on with
``disable_by_batch_size`` (speculation skipped in steps with more running requests than that).
Where a step is memory-bound, the verified drafts ride along almost free; where a batch is
large the drafts cost compute that the batch itself could have used: the cut-off is there to
stop speculating where it stops paying.
"""

from __future__ import annotations

import copy
import json
import shlex
import types
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.study import engines
from benchmarks.study.driver import DriverRequest, warm_up
from benchmarks.study.experiments import (
    INF,
    SLO,
    Outcome,
    RunContext,
    engine_point,
    engine_server_points,
    kv_blocks,
    kv_engine_kwargs,
    kv_fields,
    make_engine,
    model_folder,
    options_of,
    repeats_of,
    server_argv,
    server_points,
    sweep_args,
)
from benchmarks.study.workloads import chat_requests, chatterbot_samples, model_size
from kvserve.bench import sweep
from kvserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class Exp7Config:
    request_rates: tuple[float, ...] = (1.0, 2.0, 4.0, INF)
    num_prompts: int = 24
    max_output_len: int = 128  # greedy until EOS, capped here
    max_num_seqs: int = 16
    kv_cache: str = "256blocks"  # roomy: no preemption
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4


EXP7_QUICK = Exp7Config((INF,), 4, 16, 4, "64blocks", 2, 2, 2)


def tag_kv(points: list[dict[str, Any]], blocks: int) -> None:
    """The KV cache of a server experiment's points, in kvserve's 16-token blocks."""
    for p in points:
        p.update(num_kv_blocks=blocks, kv_tokens=16 * blocks)


def speculative_config(cfg: Exp7Config, cut_off: bool) -> str:
    spec: dict[str, Any] = {
        "method": "ngram",
        "num_speculative_tokens": cfg.num_speculative_tokens,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": cfg.prompt_lookup_max,
    }
    if cut_off:
        spec["disable_by_batch_size"] = cfg.disable_by_batch_size
    return json.dumps(spec, separators=(",", ":"))


def variants(cfg: Exp7Config) -> dict[str, str]:
    """Label -> extra server flags."""
    return {
        "off": "",
        "ngram": "--speculative-config " + shlex.quote(speculative_config(cfg, False)),
        f"ngram, off above {cfg.disable_by_batch_size} running": (
            "--speculative-config " + shlex.quote(speculative_config(cfg, True))
        ),
    }


def exp7(ctx: RunContext) -> Outcome:
    """kvserve's HTTP server, grounded prompts, greedy until EOS (capped), three speculation
    settings x request rates, repeated ``ctx.repeats`` times with fresh servers."""
    from benchmarks.spec_decode import write_grounded

    cfg = EXP7_QUICK if ctx.quick else Exp7Config()
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    data = write_grounded(ctx.work_dir / "grounded.json", cfg.num_prompts, ctx.seed)
    dataset = [
        "--backend", "openai-chat", "--dataset-name", "sharegpt", "--dataset-path", str(data),
        "--sharegpt-output-len", str(cfg.max_output_len), "--num-prompts", str(cfg.num_prompts),
        "--temperature", "0", *SLO,
    ]  # fmt: skip
    size = model_size(model_folder(ctx.model))
    per_block = size["kv_bytes_per_token_bf16"] * 16
    base = sweep_args(server_argv(ctx, dataset, cfg.kv_cache))
    setting = sweep.EngineSetting(max_num_seqs=cfg.max_num_seqs)

    names = list(variants(cfg))

    def once(label: str, rep: int) -> list[dict[str, Any]]:
        args = copy.copy(base)
        args.server_extra_args = f"{base.server_extra_args} {variants(cfg)[label]}".strip()
        work = ctx.work_dir / f"exp7-{names.index(label)}-{rep}"
        points = server_points(args, [setting], cfg.request_rates, work)
        return [{**p, "speculation": label} for p in points]

    points = []
    for rep in range(ctx.repeats):
        for label in engines.engine_order(names, rep):
            points += [{**p, "engine": "kvserve", "repeat": rep} for p in once(label, rep)]
    tag_kv(points, kv_blocks(cfg.kv_cache, per_block))
    return Outcome(
        "exp7",
        "Speculative decoding across request rates (n-gram, grounded prompts, HTTP server)",
        points,
        {"config": asdict(cfg), "variants": variants(cfg), "model_size": size},
        {"lab_settings": options_of(base)},
    )


# -- experiment 8: weight quantization at a fixed memory budget --------------------------------


@dataclass(frozen=True)
class Exp8Config:
    quantizations: tuple[str, ...] = ("bf16", "int8", "int4")
    kv_cache: str = "22.5MiB"  # bf16's KV; the budget is bf16's weights plus this
    num_prompts: int = 32
    max_tokens: int = 256  # a cap: outputs end at EOS
    temperature: float = 0.7
    max_num_seqs: int = 32


EXP8_QUICK = Exp8Config(("bf16", "int8"), "16blocks", 4, 16, 0.7, 4)


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every tensor the model holds, each storage once (a tied head, views): its
    parameters and buffers and the packed weights its layers keep as plain attributes
    (quantized codes and scales, fused panels), found by walking the modules' attributes.
    The KV cache's storages are left out."""
    assert engine.runner is not None, "the study's engines run in process"
    kv = {_storage(t)[0] for t in _tensors(engine.runner.kv_caches)}
    seen: dict[int, int] = {}
    for module in engine.runner.model.modules():
        for t in _tensors(list(vars(module).values())):
            key, nbytes = _storage(t)
            if key not in kv:
                seen[key] = nbytes
    return sum(seen.values())


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of ``t``'s storage; a oneDNN-packed (opaque) tensor is its own."""
    try:
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    except NotImplementedError:  # OpaqueTensorImpl: no storage to share
        return id(t), t.numel() * t.element_size()


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors in ``obj``: itself, or inside dicts, lists, tuples and plain objects (3 deep;
    modules are walked by ``modules()`` itself)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (type, types.ModuleType)):  # classes and Python modules: no weights
        return []
    if depth > 3 or isinstance(obj, (torch.nn.Module, str, bytes, int, float)) or obj is None:
        return []
    if isinstance(obj, dict):
        items: Any = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, depth + 1)]


def exp8(ctx: RunContext) -> Outcome:
    """Engine-only, exp 4's workload (chatterbot until EOS, all at once): bf16 with a small
    KV cache, then int8 and int4 twice each: with the same KV cache (only decoding speed
    changes) and with the same total of weights + KV (the freed weight bytes become KV)."""
    cfg = EXP8_QUICK if ctx.quick else Exp8Config()
    cache: dict[str, list[DriverRequest]] = {}

    def make(engine: LLMEngine) -> list[DriverRequest]:
        if "r" not in cache:
            samples = chatterbot_samples(engine.tokenizer, cfg.num_prompts, ctx.seed)
            cache["r"] = chat_requests(
                engine.tokenizer, samples, ignore_eos=False, max_tokens=cfg.max_tokens,
                temperature=cfg.temperature, seed=ctx.seed,
            )  # fmt: skip
        return cache["r"]

    def build(quant: str, kv: dict[str, Any]) -> LLMEngine:
        q = {} if quant == "bf16" else {"quantization": quant}
        return make_engine(ctx.model, max_num_seqs=cfg.max_num_seqs, **q, **kv)

    base_kv = kv_engine_kwargs(cfg.kv_cache)
    weights = {q: weight_bytes(build(q, {"num_kv_blocks": 4})) for q in cfg.quantizations}
    base = build("bf16", base_kv)
    budget = weights["bf16"] + base.kv_info["bytes"]
    del base
    runs = [("bf16", "bf16", base_kv)]
    for q in cfg.quantizations[1:]:
        runs.append((q, "same KV", base_kv))
        runs.append((q, "same budget", {"kv_cache_memory": str(budget - weights[q])}))

    def sweep_once() -> list[dict[str, Any]]:
        points = []
        for quant, variant, kv in runs:
            engine = build(quant, kv)
            reqs = make(engine)
            warm_up(engine, reqs[0].prompt)
            p = engine_point(engine, reqs, INF, ctx.seed)
            p.update(quantization=quant, memory=variant, weights_mib=weights[quant] / 2**20,
                     max_num_seqs=cfg.max_num_seqs, **kv_fields(engine))  # fmt: skip
            p["total_mib"] = p["weights_mib"] + p["kv_cache_mib"]
            print(f"[exp8] {quant} {variant}: {p['output_throughput']:.1f} out tok/s, "
                  f"KV {p['kv_cache_mib']:.1f} MiB, {p['num_preemptions']} preemptions",
                  flush=True)  # fmt: skip
            points.append(p)
        return points

    return Outcome(
        "exp8",
        "Weight quantization at a fixed memory budget (engine-only, outputs end at EOS)",
        repeats_of(ctx, sweep_once),
        {
            "config": asdict(cfg),
            "budget_bytes": budget,
            "weight_bytes": weights,
            "model_size": model_size(model_folder(ctx.model)),
        },
    )


# -- experiment 9: priority scheduling under overload -----------------------------------------


@dataclass(frozen=True)
class Exp9Config:
    request_rates: tuple[float, ...] = (8.0, 16.0, 32.0, INF)
    num_prompts: int = 64
    max_output_len: int = 64  # reference-answer lengths capped here (ignore_eos)
    max_num_seqs: int = 8  # a small batch: above its capacity requests queue
    kv_cache: str = "256blocks"  # roomy: the batch, not the KV cache, makes the queue
    priority_mix: str = "0:0.2,1:0.8"  # a fifth of the traffic is urgent (lower runs first)
    policies: tuple[str, ...] = ("fcfs", "priority")


EXP9_QUICK = Exp9Config((INF,), 8, 8, 1, "64blocks", "0:0.25,1:0.75")


def exp9(ctx: RunContext) -> Outcome:
    """Chatterbot through the chat template (reference lengths, ignore_eos), a fifth of the
    requests with priority 0 and the rest 1, through each engine's server under FCFS and under
    priority scheduling; per class TTFT and goodput as the rate passes the server's capacity."""
    cfg = EXP9_QUICK if ctx.quick else Exp9Config()
    dataset = [
        "--backend", "openai-chat", "--dataset-name", "chatterbot",
        "--chatterbot-max-output-len", str(cfg.max_output_len), "--num-prompts",
        str(cfg.num_prompts), "--ignore-eos", "--temperature", "0",
        "--priority-mix", cfg.priority_mix, *SLO,
    ]  # fmt: skip
    size = model_size(model_folder(ctx.model))
    per_block = size["kv_bytes_per_token_bf16"] * 16
    blocks = kv_blocks(cfg.kv_cache, per_block)
    setting = sweep.EngineSetting(max_num_seqs=cfg.max_num_seqs)
    points = []
    for policy in cfg.policies:
        # a FCFS server rejects a priority field (vLLM's too): same classes, nothing sent
        labels_only = ["--priority-labels-only"] if policy == "fcfs" else []
        flags = f"--scheduling-policy {policy}"
        args = sweep_args(server_argv(ctx, [*dataset, *labels_only], cfg.kv_cache, flags))
        flag = f"--scheduling-policy {policy}"
        served = engine_server_points(
            ctx, args, [setting], cfg.request_rates, f"exp9-{policy}", blocks * per_block, flag
        )
        points += [{**p, "scheduling_policy": policy} for p in served]
    tag_kv(points, blocks)
    return Outcome(
        "exp9",
        "Priority scheduling under overload (a fifth of the requests urgent, HTTP server)",
        points,
        {"config": asdict(cfg), "model_size": size},
        {"lab_settings": options_of(sweep_args(server_argv(ctx, dataset, cfg.kv_cache)))},
    )
