"""Sweep outputs: the CSV of grid points and PNG plots (matplotlib, Agg backend).

Plots:

* ``throughput_vs_rate.png``: output throughput against request rate, one line per engine
  setting (batch size, policy...); ``inf`` is drawn right of the largest finite rate;
* ``preemptions_vs_batch.png``: preemptions against ``max_num_seqs``, one line per other
  setting and rate;
* ``throughput_vs_kv_cache.png``: output throughput against the KV cache size, one line per
  other setting and rate.

Every line has its own hollow marker and dash pattern, so lines that coincide (the same
throughput, or zero preemptions everywhere) all stay visible; y axes start at 0, counts get
integer ticks, and a plot says so when its data cannot show a trend (one KV cache size, no
preemptions at all). The ``draw_*`` functions draw on a given matplotlib ``Axes`` (tests
inspect them); the ``plot_*`` functions write the PNGs.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SETTING_KEYS = ("max_num_seqs", "kv_cache_memory", "kv_policy", "preemption_mode")
# Result keys averaged over repeats into a point (also the CSV's metric columns).
POINT_METRICS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "num_preemptions",
    "peak_num_requests_running",
    "peak_num_requests_waiting",
)
CSV_COLUMNS = (
    *SETTING_KEYS,
    "request_rate",
    "repeats",
    *POINT_METRICS,
    "output_throughput_std",
    "server_cpu_seconds",
    "server_peak_rss_mib",
    "server_cpu_s_per_1k_output_tokens",
    "result_file",
    "error",
)


def _pyplot() -> Any:
    """pyplot on the Agg backend (files only, never a display), imported on first use so that
    loading the bench CLI stays fast."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_csv(points: Sequence[dict[str, Any]], path: Path) -> None:
    """One row per point; missing values are empty cells."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for point in points:
            writer.writerow({k: "" if point.get(k) is None else point.get(k) for k in CSV_COLUMNS})


def _rate(point: dict[str, Any]) -> float:
    value = point.get("request_rate")
    return math.inf if value in (None, "inf") else float(value)


def _label(point: dict[str, Any], keys: Sequence[str]) -> str:
    parts = [f"{k}={point.get(k)}" for k in keys]
    return ", ".join(parts) or "all points"


def _rate_positions(points: Sequence[dict[str, Any]]) -> tuple[Callable[[float], float], list]:
    """x position of each rate, with inf drawn right of the largest finite rate."""
    finite = sorted({_rate(p) for p in points if not math.isinf(_rate(p))})
    inf_x = finite[-1] * 1.5 if finite else 1.0
    ticks = [(r, f"{r:g}") for r in finite]
    if any(math.isinf(_rate(p)) for p in points):
        ticks.append((inf_x, "inf"))
    return (lambda r: inf_x if math.isinf(r) else r), ticks


def kv_cache_mib(values: Sequence[str]) -> tuple[list[float], str]:
    """Numeric x values for KV cache sizes: plain numbers as given (bytes, or another engine's
    knob such as a memory fraction), sizes with units ("512MiB") in MiB, else positions."""
    try:
        return [float(v) for v in values], "kv_cache_memory"
    except ValueError:
        pass
    try:
        from kvserve.config import parse_bytes  # the engine's own parser: same units

        return [parse_bytes(v) / 2**20 for v in values], "KV cache memory (MiB)"
    except (ImportError, ValueError):
        return [float(i) for i in range(len(values))], "kv_cache_memory (index)"


def _varying(points: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """The keys whose values differ between points: only they tell the lines apart."""
    return [k for k in keys if len({str(p.get(k)) for p in points}) > 1]


# Overlapping lines (equal throughput, zero preemptions at every point) must stay visible:
# every line gets its own hollow marker shape and dash pattern, so a line drawn over another
# still shows the one below.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":")


def _lines(
    ax: Any,
    points: Sequence[dict[str, Any]],
    x_of: Callable[[dict[str, Any]], float],
    y_key: str,
    group_keys: Sequence[str],
) -> list[float]:
    """Draw one line per group (in order of first appearance); return the y values drawn."""
    usable = [p for p in points if isinstance(p.get(y_key), (int, float))]
    label_keys = _varying(usable, group_keys)
    groups: dict[str, list[tuple[float, float]]] = {}
    for p in usable:
        groups.setdefault(_label(p, label_keys), []).append((x_of(p), float(p[y_key])))
    for i, (label, xy) in enumerate(groups.items()):
        xy.sort()
        ax.plot(
            [x for x, _ in xy],
            [y for _, y in xy],
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=max(4.0, 10.0 - 1.5 * i),  # later (top) markers smaller: both show
            markerfacecolor="none",
            markeredgewidth=1.5,
            linestyle=_LINESTYLES[i % len(_LINESTYLES)],
            label=label,
        )
    if len(groups) > 1:
        ax.legend(fontsize="small")
    return [float(p[y_key]) for p in usable]


def _note(ax: Any, text: str) -> None:
    """A short remark in the plot's upper left corner (what the data cannot show)."""
    ax.text(
        0.02, 0.97, text, transform=ax.transAxes, ha="left", va="top", fontsize="small",
        color="dimgray",
    )  # fmt: skip


def _y_from_zero(ax: Any, ys: Sequence[float], integer: bool = False) -> None:
    """Counts and rates are never negative: the axis starts at 0 (honest ratios, and no
    ``-0.04 preemptions`` ticks when every value is 0), with a small margin below so that a
    line at 0 is not hidden by the frame; integer ticks for counts."""
    top = max(ys, default=0.0)
    top = top * 1.1 if top > 0 else 1.0
    ax.set_ylim(bottom=-0.03 * top, top=top)
    if integer:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(fig: Any, ax: Any, drawn: int, path: Path) -> Path:
    if drawn == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def draw_throughput_vs_rate(ax: Any, points: Sequence[dict[str, Any]]) -> int:
    """Output throughput against request rate, one line per engine setting; returns the
    number of points drawn."""
    x_of, ticks = _rate_positions(points)
    ys = _lines(ax, points, lambda p: x_of(_rate(p)), "output_throughput", SETTING_KEYS)
    if ticks:
        ax.set_xticks([t for t, _ in ticks], [lbl for _, lbl in ticks])
    _y_from_zero(ax, ys)
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="output throughput (tok/s)",
        title="Output throughput vs request rate",
    )
    return len(ys)


def draw_preemptions_vs_batch(ax: Any, points: Sequence[dict[str, Any]]) -> int:
    """Preemptions against max_num_seqs, one line per other setting and rate."""
    usable = [p for p in points if p.get("max_num_seqs") is not None]
    others = [k for k in SETTING_KEYS if k != "max_num_seqs"] + ["request_rate"]
    ys = _lines(ax, usable, lambda p: float(p["max_num_seqs"]), "num_preemptions", others)
    if usable:
        ax.set_xticks(sorted({float(p["max_num_seqs"]) for p in usable}))
    _y_from_zero(ax, ys, integer=True)
    if ys and not any(ys):
        _note(ax, "no preemptions at any point")
    ax.set(
        xlabel="max_num_seqs (batch size)", ylabel="preemptions", title="Preemptions vs batch size"
    )
    return len(ys)


def draw_throughput_vs_kv(ax: Any, points: Sequence[dict[str, Any]]) -> int:
    """Output throughput against the KV cache size, one line per other setting and rate."""
    usable = [p for p in points if p.get("kv_cache_memory") is not None]
    sizes = sorted({str(p["kv_cache_memory"]) for p in usable})
    xs, xlabel = kv_cache_mib(sizes)
    x_by_size = dict(zip(sizes, xs, strict=True))
    others = [k for k in SETTING_KEYS if k != "kv_cache_memory"] + ["request_rate"]
    ys = _lines(
        ax, usable, lambda p: x_by_size[str(p["kv_cache_memory"])], "output_throughput", others
    )
    if xs:
        # Ticks at the sizes measured, not matplotlib's fractional ones around them.
        ax.set_xticks(sorted(set(xs)), [f"{x:g}" for x in sorted(set(xs))])
    if len(sizes) == 1:
        _note(ax, "one KV cache size only: sweep several --kv-cache-memory values for a trend")
    _y_from_zero(ax, ys)
    ax.set(
        xlabel=xlabel,
        ylabel="output throughput (tok/s)",
        title="Output throughput vs KV cache size",
    )
    return len(ys)


DrawFunc = Callable[[Any, Sequence[dict[str, Any]]], int]


def _save(draw: DrawFunc, points: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    return _finish(fig, ax, draw(ax, points), path)


def plot_throughput_vs_rate(points: Sequence[dict[str, Any]], path: Path) -> Path:
    return _save(draw_throughput_vs_rate, points, path)


def plot_preemptions_vs_batch(points: Sequence[dict[str, Any]], path: Path) -> Path:
    return _save(draw_preemptions_vs_batch, points, path)


def plot_throughput_vs_kv(points: Sequence[dict[str, Any]], path: Path) -> Path:
    return _save(draw_throughput_vs_kv, points, path)


def write_plots(points: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """All three plots into ``out_dir``; returns their paths."""
    return [
        plot_throughput_vs_rate(points, out_dir / "throughput_vs_rate.png"),
        plot_preemptions_vs_batch(points, out_dir / "preemptions_vs_batch.png"),
        plot_throughput_vs_kv(points, out_dir / "throughput_vs_kv_cache.png"),
    ]
