"""The ``kvserve`` command: ``generate``, ``serve``, ``run-batch`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve.engine.arg_utils import EngineArgs
from kvserve.worker.cpu_binding import ENV_ALIAS


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print a completion from a model (default: built-in)")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    from kvserve.engine.vllm_flags import add_vllm_flags

    add_vllm_flags(p, engine_only=True)  # vLLM's other engine flags (vllm_flags.py)


def _run_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(**EngineArgs.from_cli_args(args).llm_kwargs())
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
    """torch CPU threads for this command: ``--num-threads``, else for ``serve`` one per core:
    None where ``--cpu-cores`` binds (each rank runs one thread per core of its group), else
    per rank the process's allowed cores // tensor_parallel_size.

    A server loads its model in one thread and steps it in another. Left to torch's lazy
    default, that layout ran decode steps ~20x slower on 2 cores (~300 ms instead of ~15 ms
    for a 160M model; a 32-token request took 10 s instead of 0.6 s); setting the count
    explicitly at start-up, before any thread exists, avoids it (measured, same machine).
    The count becomes ``EngineArgs.num_threads``: the engine sets it (each worker process
    its own), so ``LLM``, Ray replicas and workers get the same treatment as the CLI.
    """
    if getattr(args, "num_threads", None):
        return int(args.num_threads)
    if getattr(args, "command", None) == "serve" and str(getattr(args, "device", "cpu")) == "cpu":
        binding = getattr(args, "cpu_cores", None) or os.environ.get(ENV_ALIAS) or "auto"
        if binding.strip().lower() != "nobind":
            return None  # --cpu-cores binds: one thread per core of each rank's group
        # Tensor parallelism: one worker process per rank, each with its share of the cores
        # (set in the worker's main thread, the one that runs its model).
        ranks = max(1, int(getattr(args, "tensor_parallel_size", 1) or 1))
        return max(1, len(os.sched_getaffinity(0)) // ranks)
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` parser. ``command``: the subcommand about to run, when known; for one
    other than ``bench`` the bench lab's parsers are not built, ``bench`` only named (its
    modules import aiohttp and httpx: ~0.5 s of CPU in every ``kvserve serve`` start)."""
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    from kvserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from kvserve.server.run_batch import add_run_batch_parser

    add_run_batch_parser(sub)
    if command in (None, "bench"):
        from kvserve.bench.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        from kvserve.bench import BENCH_HELP

        sub.add_parser("bench", help=BENCH_HELP)
    return parser


def _command(argv: list[str] | None) -> str | None:
    """The subcommand named first on the command line (None for none, or ``--help``)."""
    args = sys.argv[1:] if argv is None else argv
    return args[0] if args and not args[0].startswith("-") else None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO (e.g. each /health poll of a sweep): too chatty.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser(_command(argv)).parse_args(argv)
    if hasattr(args, "num_threads"):
        args.num_threads = default_num_threads(args)  # the engine applies it
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            from kvserve.server.cli import run_serve

            return run_serve(args)
        if args.command == "run-batch":
            from kvserve.server.cli import _leave
            from kvserve.server.run_batch import run_batch

            # Leave without interpreter finalization, as `serve` does after a forced stop:
            # the engine's C++ state met finalization with "terminate called without an
            # active exception" (exit -6) after an orderly shutdown here.
            _leave(run_batch(args), run_atexit=True)
        from kvserve.bench.cli import run_bench

        return run_bench(args)
    except ValueError as e:  # bad user input: a clear message, not a traceback
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
