"""The ``bench`` command group: ``bench serve``, ``bench throughput`` and ``bench sweep``.

The top-level ``kvserve`` CLI wires it in with::

    from kvserve.bench.cli import add_bench_parser, run_bench

    add_bench_parser(subparsers)  # registers "bench" with its three subcommands
    ...
    if args.command == "bench":  # whatever dest the top-level subparsers use
        return run_bench(args)   # exit code

It also runs on its own: ``python -m kvserve.bench serve --help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvserve.bench import BENCH_HELP, report_html, serve, sweep, throughput

_DESCRIPTIONS = {
    "serve": "Benchmark a running OpenAI-compatible server (like `vllm bench serve`).",
    "throughput": "Offline engine throughput through kvserve.LLM (like `vllm bench throughput`).",
    "sweep": "Start servers over a grid of engine settings and request rates; CSV and plots.",
    "report": "One self-contained HTML page of result files: interactive plots, percentile "
    "tables, the machine record; several runs or servers overlaid.",
}


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    """Add serve/throughput/sweep under an existing ``bench`` parser."""
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,throughput,sweep,report}")
    sub.required = True
    for name, add_args in (
        ("serve", serve.add_serve_args),
        ("throughput", throughput.add_throughput_args),
        ("sweep", sweep.add_sweep_args),
        ("report", report_html.add_report_args),
    ):
        parser = sub.add_parser(
            name,
            help=_DESCRIPTIONS[name],
            description=_DESCRIPTIONS[name],
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_args(parser)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the top-level CLI's ``subparsers`` (from ``add_subparsers()``)."""
    bench = subparsers.add_parser(
        "bench",
        help=BENCH_HELP,
        description=__doc__.splitlines()[0],
    )
    add_bench_subcommands(bench)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    """Run the parsed ``bench`` subcommand; returns the process exit code.

    0 on success, 1 when a serve benchmark completed no request (so scripts notice), 2 on a
    usage or setup error (bad option, missing file or tokenizer, unreachable server).
    """
    try:
        if args.bench_command == "serve":
            result = serve.run_serve(args)
            return 0 if result["completed"] > 0 else 1
        if args.bench_command == "throughput":
            throughput.run_throughput(args)
            return 0
        if args.bench_command == "sweep":
            sweep.run_sweep(args)
            return 0
        if args.bench_command == "report":
            report_html.run_report(args)
            return 0
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvserve bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2
    print(f"unknown bench command {args.bench_command!r}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m kvserve.bench ...``)."""
    parser = argparse.ArgumentParser(prog="kvserve bench", description=__doc__.splitlines()[0])
    add_bench_subcommands(parser)
    return run_bench(parser.parse_args(argv))
