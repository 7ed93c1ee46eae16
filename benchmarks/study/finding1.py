"""Experiment 6: finding 1 settled (issue 37, item 2).

The whitepaper's finding 1: past the batch size where preemptions start, throughput *falls*.
Experiments 1 and 2 found it flat instead, with 64-token prompts. The cost of a preemption
under recompute is the prefill of everything the victim had (its prompt plus what it had
generated), while a larger batch past the preemption point gains nothing (the KV cache, not
``max_num_seqs``, caps the running batch). So the fall should grow with the prompt length and
vanish when the recompute is cheap: short prompts, or prompts still in the prefix cache.

Engine-only (the in-process driver, as experiment 2), all requests at once (rate inf), fixed
lengths (``ignore_eos``, greedy), a KV cache that holds exactly ``full_requests`` whole
requests; swept: prompt length x prefix caching on/off x ``max_num_seqs``. Each point records
the prompt tokens the engine computed at admissions beyond the prompts themselves
(``recomputed_tokens``: the recompute volume; the warm-up uses a prompt of its own, so a first
admission never hits the cache).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.study.driver import warm_up
from benchmarks.study.experiments import (
    INF,
    Outcome,
    RunContext,
    engine_point,
    kv_fields,
    make_engine,
    model_folder,
)
from benchmarks.study.workloads import fixed_length_requests, model_size

BLOCK = 16  # kvserve's KV block, tokens


@dataclass(frozen=True)
class Finding1Config:
    input_lens: tuple[int, ...] = (64, 512)
    output_len: int = 64
    full_requests: int = 8  # the KV cache holds this many whole requests (prompt + output)
    max_num_seqs: tuple[int, ...] = (4, 8, 12, 16, 32)
    prefix_caching: tuple[bool, ...] = (True, False)
    num_prompts: int = 32
    request_rate: float = INF


FINDING1_QUICK = Finding1Config((16, 40), 40, 2, (2, 6), (True, False), 6)


def kv_blocks_for(cfg: Finding1Config, input_len: int) -> int:
    """Blocks holding ``full_requests`` whole requests of ``input_len`` + ``output_len``."""
    return cfg.full_requests * math.ceil((input_len + cfg.output_len) / BLOCK)


def point(
    ctx: RunContext, cfg: Finding1Config, input_len: int, caching: bool, max_num_seqs: int
) -> dict[str, Any]:
    """One engine-only run: a fresh engine, the fixed-length requests at once."""
    engine = make_engine(
        ctx.model,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=kv_blocks_for(cfg, input_len),
        enable_prefix_caching=caching,
    )
    reqs, _ = fixed_length_requests(
        engine.tokenizer, cfg.num_prompts + 1, input_len, cfg.output_len, ctx.seed,
        engine.vocab_size,
    )  # fmt: skip
    warm_up(engine, reqs.pop().prompt)  # a prompt none of the measured ones shares
    before = engine.stats()
    p = engine_point(engine, reqs, cfg.request_rate, ctx.seed)
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    p.update(
        engine="kvserve",
        input_len=input_len,
        prefix_caching=caching,
        max_num_seqs=max_num_seqs,
        prefill_tokens_computed=queries - hits,
        prefix_cache_hit_tokens=hits,
        recomputed_tokens=queries - hits - p["total_input_tokens"],
        **kv_fields(engine),
    )
    p["recompute_per_preemption"] = (
        p["recomputed_tokens"] / p["num_preemptions"] if p["num_preemptions"] else 0.0
    )
    return p


def exp6(ctx: RunContext) -> Outcome:
    """Throughput vs max_num_seqs past the preemption point, by prompt length and caching."""
    cfg = FINDING1_QUICK if ctx.quick else Finding1Config()
    points = []
    grid = [
        (rep, n, c, b)
        for rep in range(ctx.repeats)
        for n in cfg.input_lens
        for c in cfg.prefix_caching
        for b in cfg.max_num_seqs
    ]
    for rep, input_len, caching, bs in grid:
        p = point(ctx, cfg, input_len, caching, bs)
        p["repeat"] = rep
        print(
            f"[exp6] rep={rep} in={input_len} caching={caching} max_num_seqs={bs}: "
            f"{p['output_throughput']:.1f} out tok/s, {p['num_preemptions']} preemptions, "
            f"{p['recomputed_tokens']} recomputed tokens",
            flush=True,
        )
        points.append(p)
    return Outcome(
        "exp6",
        "Finding 1: throughput past the preemption point, by prompt length and prefix caching",
        points,
        {"config": asdict(cfg), "model_size": model_size(model_folder(ctx.model))},
    )
