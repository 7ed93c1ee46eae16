"""What every experiment writes: ``results.json`` (every point with its settings), a CSV, a
markdown table and small PNG plots (matplotlib, Agg backend, dpi 80)."""

from __future__ import annotations

import csv
import math
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.bench import serve

REPO_ROOT = Path(__file__).resolve().parents[2]
DPI = 80


def commit() -> str | None:
    """``git rev-parse --short HEAD`` of the repository (read-only), or None outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine(num_threads: int) -> dict[str, Any]:
    """The machine the numbers come from (cores, CPU model and kind, load when asked)."""
    import torch

    from benchmarks.machine import cpu_paths

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": num_threads,
        "python": platform.python_version(),
        "loadavg_at_start": list(os.getloadavg()),
        # ISA flags (avx2, avx512_bf16, amx...) and kvserve's kernel variants on this CPU kind
        "cpu_paths": cpu_paths(),
    }


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Atomic JSON through the bench lab's writer (``inf`` as a string)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    serve.save_result(doc, path)


def write_csv(points: Sequence[dict[str, Any]], columns: Sequence[str], path: Path) -> None:
    """One row per point with ``columns``; missing values are empty cells."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for p in points:
            writer.writerow({c: _cell(p.get(c)) for c in columns})


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return "inf" if math.isinf(value) else round(value, 4)
    return value


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: numbers rounded, None as a dash, inf as "inf"."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(
    points: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, int]]
) -> str:
    """A markdown table of ``(key, header, digits)`` columns, one row per point."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" for _ in columns) + "|"
    rows = ["| " + " | ".join(fmt(p.get(k), d) for k, _, d in columns) + " |" for p in points]
    return "\n".join([head, rule, *rows])


# (label, xs, ys), or with the repeats' spread: (label, xs, ys, lows, highs)
Series = (
    tuple[str, list[float], list[float]]
    | tuple[str, list[float], list[float], list[float], list[float]]
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series_by(
    points: Sequence[dict[str, Any]],
    group: Callable[[dict[str, Any]], str],
    x_of: Callable[[dict[str, Any]], float],
    y_key: str,
) -> list[Series]:
    """One (label, xs, ys) per group, in order of first appearance, sorted by x; where every
    point of a group has the repeats' ``{y_key}_min`` / ``_max`` (benchmarks/study/engines.py),
    (label, xs, ys, lows, highs)."""
    groups: dict[str, list[tuple[float, float, Any, Any]]] = {}
    for p in points:
        y = p.get(y_key)
        if isinstance(y, (int, float)):
            lo, hi = p.get(f"{y_key}_min"), p.get(f"{y_key}_max")
            groups.setdefault(group(p), []).append((x_of(p), float(y), lo, hi))
    out: list[Series] = []
    for k, v in groups.items():
        v.sort(key=lambda t: t[0])
        xs, ys = [t[0] for t in v], [t[1] for t in v]
        if all(t[2] is not None and t[3] is not None for t in v):
            out.append((k, xs, ys, [float(t[2]) for t in v], [float(t[3]) for t in v]))
        else:
            out.append((k, xs, ys))
    return out


def panels_plot(
    panels: Sequence[dict[str, Any]], path: Path, title: str, width: float = 4.6
) -> Path:
    """Side-by-side line panels. Each panel: ``series``, ``xlabel``, ``ylabel``, optional
    ``title``, ``xticks`` (value list), ``xticklabels``, ``logx`` (base 2)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 3.6), squeeze=False)
    colors: dict[str, str] = {}  # one color per label in every panel (some lack a series)
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, xs, ys, *spread in panel["series"]:
            color = colors.setdefault(label, f"C{len(colors) % 10}")
            line = ax.plot(xs, ys, marker="o", markersize=4, label=label, color=color)[0]
            if spread:  # the repeats' min..max around the median
                lows, highs = spread
                yerr = [[y - lo for y, lo in zip(ys, lows, strict=True)],
                        [hi - y for y, hi in zip(ys, highs, strict=True)]]  # fmt: skip
                ax.errorbar(xs, ys, yerr=yerr, fmt="none", ecolor=line.get_color(), capsize=3)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("xticks") is not None:
            ax.set_xticks(
                panel["xticks"], panel.get("xticklabels") or [f"{t:g}" for t in panel["xticks"]]
            )
            ax.minorticks_off()
        ax.set_ylim(bottom=0)  # small differences must not look large
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("title"):
            ax.set_title(panel["title"], fontsize="medium")
        ax.grid(True, alpha=0.3)
        if len(panel["series"]) > 1:
            ax.legend(fontsize="x-small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# Columns every CSV carries after the experiment's own (settings first, then metrics).
CSV_EXTRA = (
    "engine",
    "repeats",
    "model",
    "mode",
    "part",
    "max_num_seqs",
    "kv_cache",
    "num_kv_blocks",
    "kv_tokens",
    "kv_cache_mib",
    "kv_policy",
    "preemption_mode",
    "request_rate",
    "num_prompts",
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "output_throughput_min",
    "output_throughput_max",
    "total_token_throughput",
    "num_preemptions",
    "preemptions_per_request",
    "preemptions_per_s",
    "peak_num_requests_running",
    "peak_num_requests_waiting",
    "mean_output_len",
    "frac_hit_max_tokens",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "max_send_lag_s",
)
