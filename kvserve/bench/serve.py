"""``kvserve bench serve``: online serving benchmark of any OpenAI-compatible server.

Builds a dataset, schedules the requests (arrival rate, burstiness, concurrency cap), streams
them to the server, and reports throughput, TTFT/TPOT/ITL/E2E latency statistics, goodput and
the server's own preemption and queue metrics, in the shape of ``vllm bench serve`` (same
printed table, same result-file keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from kvserve.bench import client, options
from kvserve.bench.arrivals import arrival_times
from kvserve.bench.client import RequestInput, RequestRecord
from kvserve.bench.datasets import SampleRequest, get_samples
from kvserve.bench.metrics import calculate_metrics, parse_goodput, parse_percentiles, parse_slo
from kvserve.bench.report import format_summary
from kvserve.bench.runner import SendFunc, run_requests
from kvserve.bench.server_metrics import MetricsPoller, scrape, summarize_server_metrics
from kvserve.bench.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every option of ``bench serve`` (the sweep reuses them)."""
    g = parser.add_argument_group("server")
    g.add_argument("--backend", default="openai", choices=sorted(client.BACKENDS))
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="Default: the backend's endpoint.")
    g.add_argument("--model", default=None, help="Model name; default: the server's first.")
    g.add_argument("--served-model-name", default=None, help="Name sent in requests.")
    g.add_argument("--api-key", default=None, help="Bearer token (else $OPENAI_API_KEY).")
    g.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE")
    g.add_argument("--request-timeout", type=float, default=6 * 3600, help="Seconds.")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0)
    t = parser.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"), help="Requests/s.")
    t.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps.")
    t.add_argument("--arrival-distribution", default="poisson", choices=["poisson", "constant"])
    t.add_argument(
        "--normalize-arrivals",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Rescale random arrivals so the offered rate is exact (vLLM does this).",
    )
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--num-warmups", type=int, default=0, help="Uncounted warm-up requests.")
    r = parser.add_argument_group("report")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", "--percentiles", dest="percentiles", default=None)
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS")
    r.add_argument("--slo", default=None, help="ttft=MS,tpot=MS,e2e=MS (same as --goodput)")
    r.add_argument("--metrics-interval", type=float, default=0.5, help="/metrics poll, s.")
    r.add_argument("--no-server-metrics", action="store_true", help="Do not scrape /metrics.")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--label", default=None)
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--save-detailed", action="store_true", help="Also every request.")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    options.add_dataset_args(parser)
    options.add_output_mode_args(parser)
    options.add_sampling_args(parser)


def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, found, value = item.partition("=")
        if not found:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}.")
        out[key.strip()] = value.strip()
    return out


def urls(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, API URL) from --base-url or --host/--port, and --endpoint or the backend's."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or client.DEFAULT_ENDPOINTS[args.backend]
    return base, base + endpoint


def slo_from_args(args: argparse.Namespace) -> dict[str, float] | None:
    """--goodput and --slo merged (both in ms); None when neither is given."""
    slo: dict[str, float] = {}
    if args.goodput:
        slo.update(parse_goodput(args.goodput))
    if args.slo:
        slo.update(parse_slo(args.slo))
    return slo or None


def build_inputs(
    samples: list[SampleRequest], args: argparse.Namespace, api_url: str, model: str
) -> list[RequestInput]:
    """One RequestInput per sample with the run's output-length mode and sampling fields."""
    ignore_eos = options.resolve_ignore_eos(args)
    headers = client.build_headers(args.api_key, _key_values(args.header, "--header"))
    body = options.sampling_body(args)
    return [
        RequestInput(
            api_url=api_url,
            model=model,
            prompt=s.prompt,
            prompt_len=s.prompt_len,
            max_tokens=args.max_tokens or s.expected_output_len,
            chat_messages=s.chat_messages,
            ignore_eos=ignore_eos,
            extra_body=body,
            headers=headers,
            expected_output_len=s.expected_output_len,
        )
        for s in samples
    ]


async def _model_name(
    session: aiohttp.ClientSession, base_url: str, args: argparse.Namespace
) -> str:
    """The request model name; with a ready check, retried while the server is starting."""
    deadline = time.monotonic() + max(0, args.ready_check_timeout_sec)
    while True:
        try:
            return await client.choose_model_name(
                session, base_url, args.model, args.served_model_name
            )
        except (aiohttp.ClientError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def _ready_check(send: SendFunc, inp: RequestInput, timeout_s: float) -> None:
    """Send ``inp`` until it succeeds, for servers that are still loading."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = await send(inp)
        if record.success:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready after {timeout_s} s: {record.error}")
        await asyncio.sleep(1.0)


async def _warm_up(send: SendFunc, inputs: list[RequestInput], n: int, cap: int | None) -> None:
    """``n`` requests cycling over the dataset, not measured (JIT, caches, connections)."""
    if n <= 0:
        return
    print(f"Warming up with {n} requests...")
    warm = [inputs[i % len(inputs)] for i in range(n)]
    result = await run_requests(warm, send, [0.0] * n, cap)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        print(f"WARNING: {len(failed)} warm-up requests failed, first error: {failed[0]}")


async def measure(
    args: argparse.Namespace,
    inputs: list[RequestInput],
    send: SendFunc,
    base_url: str,
) -> tuple[list[RequestRecord], float, float, dict[str, Any]]:
    """The measured run: arrivals, progress bar, /metrics scrapes around and during it."""
    from tqdm import tqdm

    offsets = arrival_times(
        len(inputs),
        args.request_rate,
        args.burstiness,
        seed=args.seed,
        distribution=args.arrival_distribution,
        normalize=args.normalize_arrivals,
    )
    metrics_url = f"{base_url}/metrics"
    on = not args.no_server_metrics
    # Its own session: scrapes must never take a connection from, or wait behind, requests.
    async with aiohttp.ClientSession() as metrics_session:
        before = await scrape(metrics_session, metrics_url) if on else None
        poller = MetricsPoller(metrics_session, metrics_url, args.metrics_interval)
        if on:
            poller.start()
        with tqdm(total=len(inputs), disable=args.disable_tqdm, file=sys.stderr) as bar:
            result = await run_requests(
                inputs, send, offsets, args.max_concurrency, on_done=lambda _: bar.update(1)
            )
        during = await poller.stop() if on else []
        after = await scrape(metrics_session, metrics_url) if on else None
    server = summarize_server_metrics(before, after, during).to_dict()
    return result.records, result.duration, result.max_send_lag, server


async def benchmark(
    args: argparse.Namespace,
    samples: list[SampleRequest],
    tokenizer: PreTrainedTokenizerBase | None,
) -> dict[str, Any]:
    """Run one serving benchmark against the server named by ``args``; return the result."""
    base_url, api_url = urls(args)
    counter: client.TokenCounter | None = None
    if tokenizer is not None:
        counter = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    async with client.make_session(args.request_timeout) as session:
        model = await _model_name(session, base_url, args)
        inputs = build_inputs(samples, args, api_url, model)
        send = partial(_send, client.BACKENDS[args.backend], session, counter)
        if args.ready_check_timeout_sec > 0:
            await _ready_check(send, inputs[0], args.ready_check_timeout_sec)
        await _warm_up(send, inputs, args.num_warmups, args.max_concurrency)
        records, duration, lag, server = await measure(args, inputs, send, base_url)
    _warn_about(records, lag)
    return build_result(args, model, records, duration, lag, server)


def _warn_about(records: list[RequestRecord], max_send_lag: float) -> None:
    """Say what could make the numbers misleading: failures and a client that fell behind."""
    errors = [r.error for r in records if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; distinct errors (up to 5):")
        for error in list(dict.fromkeys(errors))[:5]:
            print(f"  {error}")
    if max_send_lag > 0.1:
        print(
            f"WARNING: requests were sent up to {max_send_lag:.2f} s behind schedule; the "
            "client could not keep up and the offered load was lower than asked."
        )


async def _send(
    func: Callable[..., Awaitable[RequestRecord]],
    session: aiohttp.ClientSession,
    counter: client.TokenCounter | None,
    inp: RequestInput,
) -> RequestRecord:
    return await func(session, inp, counter)


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
    result.update(_key_values(args.metadata, "--metadata"))
    result.update(metrics.to_dict())
    result["max_send_lag_s"] = max_send_lag
    result.update(server)
    result["settings"] = options.jsonable_args(args)
    if args.save_detailed:
        result.update(_detailed(records))
    return result


def _detailed(records: list[RequestRecord]) -> dict[str, list[Any]]:
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


def prepare(args: argparse.Namespace) -> tuple[list[SampleRequest], PreTrainedTokenizerBase]:
    """Validate options, load the tokenizer and build the dataset."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be positive.")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be positive.")
    options.apply_general_lengths(args)
    slo_from_args(args)  # fail on a malformed SLO before the dataset is built
    parse_percentiles(args.percentiles)
    tokenizer = load_tokenizer(args.tokenizer, args.model)
    args.tokenizer_id = getattr(tokenizer, "name_or_path", args.tokenizer)
    return get_samples(args, tokenizer), tokenizer


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Entry point of ``bench serve``: run, print the summary, save if asked; return result."""
    samples, tokenizer = prepare(args)
    result = asyncio.run(benchmark(args, samples, tokenizer))
    print(format_summary(result, args.percentile_metrics.split(",")))
    if args.save_result or args.save_detailed:
        path = result_path(args, result)
        save_result(result, path)
        print(f"Saved the result to {path}")
    return result
