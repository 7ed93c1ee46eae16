"""The printed summary of ``bench serve``, laid out like ``vllm bench serve``'s table, with
our additions: per-turn lines for multi_turn, server metrics (prefix-cache hit rate...)."""

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


def _prefix_cache_rows(result: dict[str, Any]) -> list[str]:
    """Hit rate and its token counts; nothing when the server exports no prefix-cache metric."""
    queries, hits = result.get("prefix_cache_queries"), result.get("prefix_cache_hits")
    if queries is None and hits is None:
        return []
    rate = result.get("prefix_cache_hit_rate")
    return [
        _row("Prefix cache hit rate (%):", None if rate is None else 100.0 * rate),
        _row("Prefix cache hits (tokens):", hits),
        _row("Prefix cache queries (tokens):", queries),
    ]


def _spec_decode_rows(result: dict[str, Any]) -> list[str]:
    """Acceptance of speculative decoding; nothing when the run verified no proposal."""
    if not result.get("spec_decode_num_drafts"):
        return []
    rate = result.get("spec_decode_acceptance_rate")
    return [
        _row("Spec decode acceptance rate (%):", None if rate is None else 100.0 * rate),
        _row(
            "Spec decode mean acceptance length:", result.get("spec_decode_mean_acceptance_length")
        ),
        _row("Spec decode drafts:", result.get("spec_decode_num_drafts")),
        _row("Spec decode draft tokens:", result.get("spec_decode_num_draft_tokens")),
        _row("Spec decode accepted tokens:", result.get("spec_decode_num_accepted_tokens")),
    ]


def _fmt(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _turn_rows(result: dict[str, Any]) -> list[str]:
    """multi_turn: one line per turn number, to show TTFT against the growing history."""
    turns = result.get("turns")
    if not turns:
        return []
    lines = [_section(f"Per turn ({result.get('num_conversations')} conversations)")]
    lines.append(f"{'turn':>4} {'done':>5} {'in tok':>8} {'cached':>8} {'TTFT p50':>9} {'p99':>9}")
    for t in turns:
        lines.append(
            f"{t['turn']:>4} {t['completed']:>5} {_fmt(t['mean_input_tokens']):>8} "
            f"{_fmt(t['mean_cached_tokens']):>8} {_fmt(t['median_ttft_ms']):>9} "
            f"{_fmt(t['p99_ttft_ms']):>9}"
        )
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
    if result.get("total_cached_tokens") is not None:  # usage.prompt_tokens_details
        lines.append(_row("Total cached prompt tokens:", result["total_cached_tokens"]))
    lines.append(_row("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines.append(_row("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_row("Total token throughput (tok/s):", result["total_token_throughput"]))
    lines.append(_row("Peak concurrent requests:", result.get("max_concurrent_requests")))
    for metric in metrics:
        if metric.strip() in _HEADERS:
            lines.extend(_latency_rows(result, metric.strip()))
    lines.extend(_turn_rows(result))
    source = result.get("server_metrics_source")
    if source is not None:
        lines.append(_section(f"Server metrics ({source})"))
        lines.append(_row("Preemptions:", result.get("num_preemptions")))
        lines.append(_row("Peak running requests:", result.get("peak_num_requests_running")))
        lines.append(_row("Peak waiting requests:", result.get("peak_num_requests_waiting")))
        lines.extend(_prefix_cache_rows(result))
        lines.extend(_spec_decode_rows(result))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
