"""The printed summary of ``bench serve``, laid out like ``vllm bench serve``'s table."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_WIDTH = 50
_HEADERS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: Any) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.2f}"
    else:
        shown = str(value)
    return f"{label:<40} {shown:<10}"


def _section(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _latency_rows(result: dict[str, Any], metric: str) -> list[str]:
    header, short = _HEADERS[metric]
    lines = [_section(header)]
    lines.append(_row(f"Mean {short} (ms):", result.get(f"mean_{metric}_ms")))
    lines.append(_row(f"Median {short} (ms):", result.get(f"median_{metric}_ms")))
    lines.append(_row(f"Std {short} (ms):", result.get(f"std_{metric}_ms")))
    pattern = re.compile(rf"^p([0-9.]+)_{metric}_ms$")
    for key in result:
        m = pattern.match(key)
        if m:
            lines.append(_row(f"P{m.group(1)} {short} (ms):", result[key]))
    return lines


def format_summary(result: dict[str, Any], metrics: Sequence[str] = tuple(_HEADERS)) -> str:
    """The result table: counts, throughput, latency sections, server metrics."""
    lines = [_section(" Serving Benchmark Result ", "=")]
    lines.append(_row("Successful requests:", result["completed"]))
    lines.append(_row("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_row("Request rate configured (RPS):", float(result["request_rate"])))
    lines.append(_row("Benchmark duration (s):", result["duration"]))
    lines.append(_row("Total input tokens:", result["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines.append(_row("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_row("Total token throughput (tok/s):", result["total_token_throughput"]))
    lines.append(_row("Peak concurrent requests:", result.get("max_concurrent_requests")))
    for metric in metrics:
        if metric.strip() in _HEADERS:
            lines.extend(_latency_rows(result, metric.strip()))
    source = result.get("server_metrics_source")
    if source is not None:
        lines.append(_section(f"Server metrics ({source})"))
        lines.append(_row("Preemptions:", result.get("num_preemptions")))
        lines.append(_row("Peak running requests:", result.get("peak_num_requests_running")))
        lines.append(_row("Peak waiting requests:", result.get("peak_num_requests_waiting")))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
