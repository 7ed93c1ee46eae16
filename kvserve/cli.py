"""The ``kvserve`` command: ``generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine."""
    p.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16 or float32")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests per batch")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="most tokens computed per step (longer prefills are chunked)",
    )
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-policy", choices=["preempt", "reserve"], default="preempt")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--swap-space", default="4GiB", help="CPU swap space for --preemption-mode swap")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes across requests (vLLM's flag)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="admission order: first come first served, or by the request's priority "
        "(lower first; with --kv-policy preempt a waiting request may preempt a running one)",
    )
    p.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=1,
        help="with --scheduling-policy priority: how much lower a waiting request's priority "
        "must be to preempt a running request",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="cap on the context length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--attention-backend",
        choices=["auto", "sdpa", "cpu_kernel"],
        default="auto",
        help="decode attention: C++ kernel on CPU (auto) or gather + SDPA",
    )
    p.add_argument(
        "--no-fused-ops",
        action="store_true",
        help="keep RMSNorm, SiLU*up and RoPE as PyTorch op chains (bf16 CPU fuses them)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice, one per core)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": args.kv_cache_memory,
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": args.block_size,
        "kv_policy": args.kv_policy,
        "preemption_mode": args.preemption_mode,
        "scheduling_policy": args.scheduling_policy,
        "priority_scheduling_preemption_threshold": args.priority_scheduling_preemption_threshold,
        "swap_space": args.swap_space,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "fused_ops": not args.no_fused_ops,
    }


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print a completion from a model (default: built-in)")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="model folder or GGUF file (default: built-in)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))  # type: ignore[arg-type]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def default_num_threads(args: argparse.Namespace) -> int | None:
    """torch CPU threads for this command: ``--num-threads``, else one per core for ``serve``.

    A server loads its model in one thread and steps it in another. Left to torch's lazy
    default, that layout ran decode steps ~20x slower on 2 cores (~300 ms instead of ~15 ms
    for a 160M model; a 32-token request took 10 s instead of 0.6 s); setting the count
    explicitly at start-up, before any thread exists, avoids it (measured, same machine).
    """
    if getattr(args, "num_threads", None):
        return int(args.num_threads)
    if getattr(args, "command", None) == "serve" and str(getattr(args, "device", "cpu")) == "cpu":
        return os.cpu_count() or 1
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    from kvserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO (e.g. each /health poll of a sweep): too chatty.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    threads = default_num_threads(args)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            from kvserve.server.cli import run_serve

            return run_serve(args)
        from kvserve.bench.cli import run_bench

        return run_bench(args)
    except ValueError as e:  # bad user input: a clear message, not a traceback
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
