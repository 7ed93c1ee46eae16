"""``kvserve bench report``: runs of the bench lab as one self-contained HTML page.

Interactive plots (Bokeh, its JavaScript inlined, so the file opens with no network): output
and request throughput, TTFT/TPOT/E2EL percentiles and preemptions against the load, every
series of every run overlaid (click a legend entry to hide it, hover a point for its numbers
and input file); a percentile table per section; the machine record of every run.

Each plotted point's data source row carries ``source`` (``file#index``) and ``key`` (the
metric's name in that file), so a reader (tests/bench/test_report.py) can check every plotted
number against its input exactly.
"""

from __future__ import annotations

import argparse
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.report_runs import NO_X, Run, Series, factor_order, fmt_value, load_runs

INSTALL_HINT = "kvserve bench report needs Bokeh: pip install 'kvserve[report]' (bokeh>=3.4)."
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip  # Category10
DASHES = ("solid", "dashed", "dotted", "dashdot")
MARKERS = ("circle", "square", "triangle", "diamond")
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))


@dataclass(frozen=True)
class Section:
    """Series plotted together: one x axis (``x_key``) and the same figures."""

    title: str
    x_key: str
    series: tuple[Series, ...]


@dataclass(frozen=True)
class FigureSpec:
    """One plot: a title, a y label and the metric keys drawn as lines, with their labels."""

    fig_id: str
    title: str
    y_label: str
    stats: tuple[tuple[str, str], ...]  # (label in the legend, metric key)
    std_key: str | None = None  # drawn as whiskers (repeat spread) when present


def sections(runs: Sequence[Run], separate: bool) -> list[Section]:
    """Overlay: one section per x axis, all runs' series together; ``separate``: one per run."""
    if separate:
        return [Section(_run_title(run), run.x_key(), tuple(run.series())) for run in runs]
    by_x: dict[str, list[Series]] = {}
    for run in runs:
        by_x.setdefault(run.x_key(), []).extend(run.series())
    return [Section(f"vs {x}", x, tuple(s)) for x, s in by_x.items()]


def _run_title(run: Run) -> str:
    title = run.record.get("title")
    return f"{run.name}: {title}" if title else run.name


def _percentile_keys(points: Sequence[Any], metric: str) -> list[tuple[str, str]]:
    """(label, key) of the percentiles present: median as p50, then pNN by NN."""
    found: dict[str, float] = {}
    for p in points:
        for key in p.values:
            if key == f"median_{metric}_ms":
                found[key] = 50.0
            m = re.fullmatch(rf"p([0-9.]+)_{metric}_ms", key)
            if m:
                found[key] = float(m.group(1))
    ordered = sorted(found.items(), key=lambda kv: kv[1])
    return [(f"p{q:g}", key) for key, q in ordered]


def figure_specs(section: Section) -> list[FigureSpec]:
    """The plots a section's points can fill (a figure with no values is left out)."""
    points = [p for s in section.series for p in s.points]

    def has(key: str, nonzero: bool = False) -> bool:
        return any(
            isinstance(p.get(key), (int, float)) and (p.get(key) or not nonzero) for p in points
        )

    specs = [
        FigureSpec(
            "output_throughput",
            "Output throughput",
            "tokens/s",
            (("output", "output_throughput"),),
            "output_throughput_std",
        ),
        FigureSpec(
            "request_throughput",
            "Request throughput and goodput",
            "requests/s",
            tuple(
                (label, key)
                for label, key in (
                    ("throughput", "request_throughput"),
                    ("goodput", "request_goodput"),
                )
                if has(key)
            ),
        ),
    ]
    for metric, name in LATENCIES:
        stats = tuple(_percentile_keys(points, metric))
        specs.append(FigureSpec(metric, f"{name} percentiles", "ms", stats))
    if has("num_preemptions", nonzero=True):
        specs.append(
            FigureSpec(
                "num_preemptions", "Preemptions", "count", (("preemptions", "num_preemptions"),)
            )
        )
    return [s for s in specs if any(has(key) for _, key in s.stats)]


def x_factor(point: Any, x_key: str) -> str:
    return NO_X if x_key == NO_X else fmt_value(point.get(x_key))


def _source_data(series: Series, x_key: str, key: str, std_key: str | None) -> dict[str, list]:
    rows = [p for p in series.points if isinstance(p.get(key), (int, float))]
    rows.sort(key=lambda p: factor_order(x_factor(p, x_key)))
    data: dict[str, list] = {
        "x": [x_factor(p, x_key) for p in rows],
        "y": [float(p.get(key)) for p in rows],
        "source": [f"{p.source}#{p.index}" for p in rows],
        "key": [p.source_key(key) for p in rows],
        "series": [series.label] * len(rows),
    }
    if std_key:
        std = [float(p.get(std_key) or 0.0) for p in rows]
        data["lower"] = [y - s for y, s in zip(data["y"], std, strict=True)]
        data["upper"] = [y + s for y, s in zip(data["y"], std, strict=True)]
    return data


def build_figure(section: Section, spec: FigureSpec, factors: list[str]) -> Any:
    """A Bokeh figure of ``spec`` for every series of ``section``; points carry their source."""
    from bokeh.models import ColumnDataSource, HoverTool, Legend, Line, Scatter, Whisker
    from bokeh.plotting import figure

    fig = figure(
        x_range=factors,
        height=340,
        sizing_mode="stretch_width",
        title=spec.title,
        tools="pan,wheel_zoom,box_zoom,reset,save",
        name=f"fig:{spec.fig_id}",
        x_axis_label=section.x_key if section.x_key != NO_X else "",
        y_axis_label=spec.y_label,
    )
    scatters, items = [], []
    for i, series in enumerate(section.series):
        color = PALETTE[i % len(PALETTE)]
        for j, (stat, key) in enumerate(spec.stats):
            std = spec.std_key if any(p.get(spec.std_key or "") for p in series.points) else None
            data = _source_data(series, section.x_key, key, std)
            if not data["x"]:
                continue
            src = ColumnDataSource(data, name=f"src:{spec.fig_id}")
            # add_glyph, not fig.line/scatter: those add muted and nonselection copies of
            # every glyph, models Bokeh then walks and serialises (experiment 4's 6 figures:
            # 9.2 s -> 5.1-6.1 s at a load average of 12 on 2 cores)
            dash = DASHES[j % len(DASHES)]
            line = fig.add_glyph(
                src, Line(x="x", y="y", line_color=color, line_dash=dash, line_width=2)
            )
            marker = MARKERS[j % len(MARKERS)]
            dots = fig.add_glyph(
                src,
                Scatter(
                    x="x",
                    y="y",
                    size=8,
                    marker=marker,
                    line_color=color,
                    fill_color=color,
                    fill_alpha=0.6,
                ),
            )
            dots.name, dots.tags = "points", [spec.fig_id, stat, series.label]
            if std:
                fig.add_layout(
                    Whisker(source=src, base="x", lower="lower", upper="upper", line_color=color)
                )
            label = series.label if len(spec.stats) == 1 else f"{series.label} {stat}"
            items.append((label, [line, dots]))
            scatters.append(dots)
    # Tall enough for the legend (15 px an entry at 9pt): a clipped legend hides series.
    fig.height = max(fig.height, 50 + 17 * len(items))
    fig.y_range.start = 0
    fig.add_tools(
        HoverTool(
            renderers=scatters,
            tooltips=[
                ("series", "@series"),
                ("x", "@x"),
                (spec.y_label, "@y{0,0.00}"),
                ("from", "@source"),
            ],
        )
    )
    legend = Legend(
        items=items,
        click_policy="hide",
        label_text_font_size="9pt",
        label_height=12,
        glyph_height=12,
        spacing=2,
        padding=4,
    )
    fig.add_layout(legend, "right")
    return fig


def _num(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return html.escape(str(value))
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


TABLE_COLUMNS = (
    ("completed", "done"),
    ("failed", "failed"),
    ("request_throughput", "req/s"),
    ("request_goodput", "goodput req/s"),
    ("output_throughput", "out tok/s"),
    ("output_throughput_std", "± std"),
    ("num_preemptions", "preempt."),
)


def percentile_table(section: Section) -> str:
    """One row per point: counts, throughput, then each latency's mean and percentiles (ms)."""
    points = [p for s in section.series for p in s.points]
    cols = [(k, h) for k, h in TABLE_COLUMNS if any(p.get(k) is not None for p in points)]
    for metric, name in LATENCIES:
        stats = [("mean", f"mean_{metric}_ms"), *_percentile_keys(points, metric)]
        cols += [
            (key, f"{name} {label}")
            for label, key in stats
            if any(p.get(key) is not None for p in points)
        ]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    rows = []
    for s in section.series:
        for p in sorted(s.points, key=lambda p: factor_order(x_factor(p, section.x_key))):
            cells = "".join(f"<td>{_num(p.get(k))}</td>" for k, _ in cols)
            rows.append(
                f"<tr><th>{html.escape(s.label)}</th>"
                f"<td>{html.escape(x_factor(p, section.x_key))}</td>{cells}</tr>"
            )
    x_head = html.escape(section.x_key if section.x_key != NO_X else "x")
    return (
        f'<table class="pct"><thead><tr><th>series</th><th>{x_head}</th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _record_value(key: str, value: Any) -> str:
    """Roofline rates in their units (``*_bytes_s`` GB/s, ``*_flop_s`` TFLOP/s); lists joined."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if key.endswith("bytes_s"):
            return f"{value / 1e9:.1f} GB/s"
        if key.endswith("flop_s"):
            return f"{value / 1e12:.3g} TFLOP/s"
        if key.endswith("ops_s"):
            return f"{value / 1e12:.3g} Tops/s"
        return _num(value)
    if isinstance(value, list):
        return html.escape(", ".join(_num(v) if isinstance(v, float) else str(v) for v in value))
    return html.escape(str(value))


def machine_table(runs: Sequence[Run]) -> str:
    """The record of every input file side by side (runs read from one file share a column)."""
    columns: dict[str, tuple[list[str], dict[str, Any]]] = {}
    for run in runs:
        columns.setdefault(run.path, ([], _flatten(run.record)))[0].append(run.name)
    keys = list(dict.fromkeys(k for _, rec in columns.values() for k in rec))
    head = "".join(f"<th>{html.escape(', '.join(names))}</th>" for names, _ in columns.values())
    rows = [
        f"<tr><th>{html.escape(k)}</th>"
        + "".join(
            f"<td>{_record_value(k, rec[k]) if k in rec else ''}</td>"
            for _, rec in columns.values()
        )
        + "</tr>"
        for k in keys
    ]
    files = "".join(f"<td><code>{html.escape(path)}</code></td>" for path in columns)
    return (
        f'<table class="rec"><thead><tr><th></th>{head}</tr></thead><tbody>'
        f"<tr><th>file</th>{files}</tr>{''.join(rows)}</tbody></table>"
    )


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.8em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
thead th { background: #f3f3f3; } tbody th { text-align: left; font-weight: normal; }
table.rec td { text-align: left; } \
.scroll { overflow-x: auto; } .note { color: #555; font-size: 0.9em; }
"""


def render_page(runs: Sequence[Run], title: str, separate: bool = False) -> str:
    """The whole report as one HTML string, Bokeh's JavaScript inlined."""
    try:
        from bokeh.embed import components
        from bokeh.embed.bundle import bundle_for_objs_and_resources
        from bokeh.resources import INLINE
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    parts, figures = [], []
    for n, section in enumerate(sections(runs, separate)):
        factors = sorted(
            {x_factor(p, section.x_key) for s in section.series for p in s.points}, key=factor_order
        )
        figs = [build_figure(section, spec, factors) for spec in figure_specs(section)]
        parts.append((n, section, len(figures), len(figs)))
        figures += figs
    script, divs = components(figures) if figures else ("", ())
    js = bundle_for_objs_and_resources(figures, INLINE).scripts() if figures else ""
    body = [
        f"<h1>{html.escape(title)}</h1>",
        '<p class="note">Runs: '
        + ", ".join(html.escape(r.name) for r in runs)
        + ". Click a legend entry to hide its line; hover a point for its value and file; "
        "drag to pan, scroll to zoom.</p>",
    ]
    for n, section, first, count in parts:
        body.append(f'<h2 id="section-{n}">{html.escape(section.title)}</h2>')
        body += [f'<div class="plot">{div}</div>' for div in divs[first : first + count]]
        body.append(f'<div class="scroll">{percentile_table(section)}</div>')
    body += [
        '<h2 id="machine">Machine and code</h2>',
        f'<div class="scroll">{machine_table(runs)}</div>',
    ]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n{js}\n</head>\n<body>\n"
        + _stable_ids("\n".join(body) + f"\n{script}")  # the library's own code untouched
        + "\n</body>\n</html>\n"
    )


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _stable_ids(page: str) -> str:
    """Bokeh's random document and element ids numbered in order of appearance, so the same
    inputs give the same file (a regenerated docs/study/report.html only changes with them)."""
    ids: dict[str, str] = {}
    return _UUID.sub(
        lambda m: ids.setdefault(m.group(0), f"00000000-0000-4000-8000-{len(ids):012d}"), page
    )


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="[NAME=]PATH: a bench serve/sweep/throughput result, a study "
        "results.json, or a directory of them",
    )
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    parser.add_argument("--title", default="kvserve bench report")
    parser.add_argument(
        "--separate",
        action="store_true",
        help="one section per run instead of every run overlaid per x axis",
    )
    parser.add_argument(
        "--screenshot",
        metavar="PNG",
        default=None,
        help="also render the report in headless Chromium into this PNG",
    )
    parser.add_argument(
        "--screenshot-height",
        type=int,
        default=2000,
        help="height in pixels of the screenshot (its width is 1280)",
    )


def run_report(args: argparse.Namespace) -> Path:
    """Entry point of ``bench report``: writes the page (and the screenshot); returns its path."""
    from kvserve.bench import report_browser

    runs = load_runs(args.runs)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(runs, args.title, args.separate), encoding="utf-8")
    print(f"[report] wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(runs)} runs)")
    if args.screenshot:
        png = report_browser.screenshot(out, Path(args.screenshot), height=args.screenshot_height)
        print(f"[report] wrote {png}")
    return out
