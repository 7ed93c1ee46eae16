"""The result of ``bench serve``: the dict in vLLM's shape, and the JSON file it is saved to."""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve.bench import lora_mix, options, priority
from kvserve.bench.client import RequestRecord
from kvserve.bench.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_percentiles,
    parse_slo,
    total_cached_tokens,
)

# Per-request lists written only with --save-detailed (vLLM's names, plus our extras).
DETAILED_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
    "output_token_sources",
    "expected_output_lens",
    "cached_tokens",
)


def key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    """``KEY=VALUE`` items (--header, --metadata) as a dict."""
    out = {}
    for item in items or []:
        key, found, value = item.partition("=")
        if not found:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}.")
        out[key.strip()] = value.strip()
    return out


def slo_from_args(args: argparse.Namespace) -> dict[str, float] | None:
    """--goodput and --slo merged (both in ms); None when neither is given."""
    slo: dict[str, float] = {}
    if args.goodput:
        slo.update(parse_goodput(args.goodput))
    if args.slo:
        slo.update(parse_slo(args.slo))
    return slo or None


def build_result(
    args: argparse.Namespace,
    model: str,
    records: list[RequestRecord],
    duration: float,
    max_send_lag: float,
    server: dict[str, Any],
) -> dict[str, Any]:
    """The result dict: vLLM's keys for setup and metrics, then server metrics and settings."""
    percentiles = parse_percentiles(args.percentiles)
    metrics = calculate_metrics(records, duration, percentiles, slo_from_args(args))
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint_type": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": getattr(args, "tokenizer_id", args.tokenizer),
        "dataset_name": args.dataset_name,
        "num_prompts": len(records),
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": options.resolve_ignore_eos(args),
    }
    result.update(key_values(args.metadata, "--metadata"))
    result.update(metrics.to_dict())
    if getattr(args, "priority_mix", None):  # the same seeded labels the requests were sent with
        mix = priority.parse_priority_mix(args.priority_mix)
        labels = priority.assign_priorities(mix, len(records), args.seed)
        result.update(
            priority.by_priority(records, labels, duration, percentiles, slo_from_args(args))
        )
    if getattr(args, "lora_modules", None):  # the same seeded order the requests were sent in
        names = lora_mix.check_modules(args.lora_modules)
        labels = lora_mix.assign_modules(names, len(records), args.seed)
        result["lora_modules"] = names
        result["requests_by_lora_module"] = lora_mix.module_counts(labels)
        if args.save_detailed:
            result["lora_module_per_request"] = labels
    result["total_cached_tokens"] = total_cached_tokens(records)
    result["max_send_lag_s"] = max_send_lag
    result.update(server)
    result["settings"] = options.jsonable_args(args)
    if args.save_detailed:
        result.update(detailed(records))
    return result


def detailed(records: list[RequestRecord]) -> dict[str, list[Any]]:
    """The per-request lists of --save-detailed (DETAILED_KEYS)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "output_token_sources": [r.output_tokens_source for r in records],
        "expected_output_lens": [r.expected_output_len for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
    }


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """--result-dir/--result-filename, else vLLM's ``{label}-{rate}qps-{model}-{date}.json``."""
    name = args.result_filename
    if not name:
        label = args.label or args.backend
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        name = f"{label}-{args.request_rate}qps{conc}-{model}-{result['date']}.json"
    folder = Path(args.result_dir) if args.result_dir else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def json_safe(value: Any) -> Any:
    """``inf``/``nan`` as strings (vLLM writes ``"inf"`` for an unlimited rate): bare
    ``Infinity`` is not JSON and breaks strict readers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def save_result(result: dict[str, Any], path: Path) -> None:
    """Write JSON atomically (a crash mid-write must not leave a truncated result)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(json_safe(result), f, indent=2, allow_nan=False)
    os.replace(tmp, path)
