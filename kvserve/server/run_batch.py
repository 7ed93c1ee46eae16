"""``kvserve run-batch -i in.jsonl -o out.jsonl``: vLLM's offline batch command.

The models load as ``serve`` loads them and the server's app is built, but nothing listens:
each line is an in-process request to that app (``batch_runner``), so a line's answer is
exactly the server's, errors included. Input lines are OpenAI's batch input format (``url``
per line: any of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, as vLLM
takes); the output file has one line per input line, in input order, in OpenAI's batch output
format (errors in the same file, as vLLM writes them). ``-`` reads stdin / writes stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

# offline there is no online traffic to leave room for: the engine's own queue orders the
# lines, and its --max-num-seqs bounds what runs at once
RUN_BATCH_CONCURRENCY = 256


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    from kvserve.server.cli import add_serve_args

    p = subparsers.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests offline and write their answers (vLLM's)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-i", "--input-file", required=True, help="batch input (JSONL); - for stdin")
    p.add_argument("-o", "--output-file", required=True, help="answers (JSONL); - for stdout")
    add_serve_args(p)
    p.set_defaults(batch_max_concurrency=RUN_BATCH_CONCURRENCY)
    return p


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")


def run_batch(args: argparse.Namespace) -> int:
    """Run every line; 0 when every line has an answer (a 4xx answer counts: it is in the
    output file, as in vLLM), 2 for an input file that is not a batch file."""
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.server.app import build_app
    from kvserve.server.batch_jobs import parse_lines
    from kvserve.server.cli import _model_specs, build_state, load_models

    lines, errors = parse_lines(_read(args.input_file), None)
    if errors:
        first = errors[0]
        raise ValueError(f"{args.input_file} line {first['line']}: {first['message']} "
                         f"({len(errors)} invalid line(s))")  # fmt: skip
    specs = _model_specs(args)
    engine_args = replace(EngineArgs.from_cli_args(args), model=None, served_model_name=None)
    state = build_state(args, engine_args)
    try:
        load_models(state, specs, args, engine_args)
        app = build_app(state)
        records = asyncio.run(_run(app, state, lines, args.batch_max_concurrency))
    finally:
        state.shutdown()
    order = {line.custom_id: line.index for line in lines}
    records.sort(key=lambda r: order[r["custom_id"]])
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        Path(args.output_file).write_text(text, encoding="utf-8")
    failed = sum(1 for r in records if r["response"]["status_code"] != 200)
    print(f"run-batch: {len(records)} lines, {failed} with an error", file=sys.stderr)
    return 0


async def _run(app: Any, state: Any, lines: list[Any], concurrency: int) -> list[dict[str, Any]]:
    from kvserve.server.batch_runner import LineSender, run_lines

    records: list[dict[str, Any]] = []

    async def commit(record: dict[str, Any]) -> None:
        records.append(record)

    sender = LineSender(app, state.api_key, state.priority_scheduling)
    await run_lines(lines, sender, asyncio.Semaphore(concurrency), commit)
    return records
