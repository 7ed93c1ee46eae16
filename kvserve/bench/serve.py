"""``kvserve bench serve``: online serving benchmark of any OpenAI-compatible server.

Builds a dataset, schedules the requests (arrival rate, burstiness, concurrency cap), streams
them to the server, and reports throughput, TTFT/TPOT/ITL/E2E latency statistics, goodput and
the server's own preemption and queue metrics, in the shape of ``vllm bench serve`` (same
printed table, same result-file keys).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import aiohttp

from kvserve.bench import client, lora_mix, multi_turn, options, priority
from kvserve.bench.arrivals import arrival_times
from kvserve.bench.client import RequestInput, RequestRecord
from kvserve.bench.datasets import SampleRequest, canonical_name, get_samples
from kvserve.bench.metrics import parse_percentiles
from kvserve.bench.multi_turn import Conversation, ConversationRunResult
from kvserve.bench.report import format_summary
from kvserve.bench.results import (  # noqa: F401  (DETAILED_KEYS, json_safe: public via serve)
    DETAILED_KEYS,
    build_result,
    json_safe,
    key_values,
    result_path,
    save_result,
    slo_from_args,
)
from kvserve.bench.runner import RunResult, SendFunc, run_requests
from kvserve.bench.server_metrics import MetricsPoller, scrape, summarize_server_metrics
from kvserve.bench.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What a benchmark sends: single requests, or multi_turn's conversations.
Workload = list[SampleRequest] | list[Conversation]
RunFunc = Callable[[Callable[[RequestRecord], None]], Awaitable[RunResult]]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every option of ``bench serve`` (the sweep reuses them)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--backend",
        default=None,
        choices=sorted(client.BACKENDS),
        help="Default: openai-chat for --dataset-name multi_turn, else openai (completions).",
    )
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="Default: the backend's endpoint.")
    g.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="--backend grpc: the server's gRPC port (kvserve serve --grpc-port), on the host "
        "of --base-url / --host; HTTP still serves /v1/models and /metrics.",
    )
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
    t.add_argument(
        "--priority-mix",
        default=None,
        metavar="PRIORITY:SHARE,...",
        help="Send vLLM's priority field, e.g. 0:0.2,1:0.8 (lower runs first under "
        "--scheduling-policy priority); the result adds each class's metrics.",
    )
    t.add_argument(
        "--priority-labels-only",
        action="store_true",
        help="With --priority-mix: label the requests into the same classes but send no "
        "priority field (the baseline on a FCFS server, which rejects one).",
    )
    t.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Send each request to one of these adapters (vLLM's flag; names the server "
        "loaded with --lora-modules NAME=PATH): every name gets an equal share of the requests "
        "in a seeded order (vLLM draws them at random).",
    )
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


def urls(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL, API URL) from --base-url or --host/--port, and --endpoint or the backend's."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.backend == "grpc":
        from kvserve.bench.grpc_client import grpc_target

        return base, grpc_target(base, args.grpc_port)
    endpoint = args.endpoint or client.DEFAULT_ENDPOINTS[args.backend]
    return base, base + endpoint


def request_template(args: argparse.Namespace, api_url: str, model: str) -> RequestInput:
    """What every request of the run shares: URL, model, output-length mode, sampling fields
    and headers; the dataset fills in the prompt and lengths."""
    headers = client.build_headers(args.api_key, key_values(args.header, "--header"))
    return RequestInput(
        api_url=api_url,
        model=model,
        prompt="",
        prompt_len=0,
        max_tokens=0,
        ignore_eos=options.resolve_ignore_eos(args),
        extra_body=options.sampling_body(args),
        headers=headers,
    )


def build_inputs(
    samples: list[SampleRequest], args: argparse.Namespace, api_url: str, model: str
) -> list[RequestInput]:
    """One RequestInput per sample with the run's output-length mode and sampling fields."""
    template = request_template(args, api_url, model)
    inputs = [
        dataclasses.replace(
            template,
            prompt=s.prompt,
            prompt_len=s.prompt_len,
            max_tokens=args.max_tokens or s.expected_output_len,
            chat_messages=s.chat_messages,
            expected_output_len=s.expected_output_len,
        )
        for s in samples
    ]
    priorities = None if args.priority_labels_only else request_priorities(args, len(inputs))
    for inp, value in zip(inputs, priorities or [], strict=priorities is not None):
        inp.extra_body = {**(inp.extra_body or {}), "priority": value}
    modules = request_modules(args, len(inputs))
    for inp, name in zip(inputs, modules or [], strict=modules is not None):
        inp.model = name
    return inputs


def request_modules(args: argparse.Namespace, n: int) -> list[str] | None:
    """The adapter each of ``n`` requests names under ``--lora-modules`` (None without it)."""
    names = getattr(args, "lora_modules", None)
    if not names:
        return None
    return lora_mix.assign_modules(lora_mix.check_modules(names), n, args.seed)


def request_priorities(args: argparse.Namespace, n: int) -> list[int] | None:
    """The priority of each of ``n`` requests under ``--priority-mix`` (None without it)."""
    spec = getattr(args, "priority_mix", None)
    if not spec:
        return None
    return priority.assign_priorities(priority.parse_priority_mix(spec), n, args.seed)


def _offsets(args: argparse.Namespace, n: int) -> list[float]:
    return arrival_times(
        n,
        args.request_rate,
        args.burstiness,
        seed=args.seed,
        distribution=args.arrival_distribution,
        normalize=args.normalize_arrivals,
    )


def plan_run(
    args: argparse.Namespace,
    samples: Workload,
    tokenizer: PreTrainedTokenizerBase | None,
    send: SendFunc,
    api_url: str,
    model: str,
) -> tuple[RunFunc, list[RequestInput], int]:
    """(the measured run, the requests warm-ups and the ready check cycle over, how many
    requests the run sends). Conversations arrive on the schedule and then play their turns;
    their warm-ups are first turns only (no conversation is played before the run)."""
    cap = args.max_concurrency
    if samples and isinstance(samples[0], Conversation):
        convs = cast(list[Conversation], samples)
        make = multi_turn.input_factory(
            request_template(args, api_url, model), tokenizer, args.max_tokens
        )
        offsets = _offsets(args, len(convs))

        def run_convs(on_done: Callable[[RequestRecord], None]) -> Awaitable[RunResult]:
            return multi_turn.run_conversations(convs, send, make, offsets, cap, on_done)

        firsts = [make(c, 0, c.messages_for(0, [])) for c in convs]
        return run_convs, firsts, sum(len(c.user_turns) for c in convs)
    inputs = build_inputs(cast(list[SampleRequest], samples), args, api_url, model)
    offsets = _offsets(args, len(inputs))

    def run_single(on_done: Callable[[RequestRecord], None]) -> Awaitable[RunResult]:
        return run_requests(inputs, send, offsets, cap, on_done=on_done)

    return run_single, inputs, len(inputs)


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
    args: argparse.Namespace, run: RunFunc, num_requests: int, base_url: str
) -> tuple[RunResult, dict[str, Any]]:
    """The measured run with a progress bar, and the /metrics scrapes around and during it."""
    from tqdm import tqdm

    metrics_url = f"{base_url}/metrics"
    on = not args.no_server_metrics
    # Its own session: scrapes must never take a connection from, or wait behind, requests.
    async with aiohttp.ClientSession() as metrics_session:
        before = await scrape(metrics_session, metrics_url) if on else None
        poller = MetricsPoller(metrics_session, metrics_url, args.metrics_interval)
        if on:
            poller.start()
        with tqdm(total=num_requests, disable=args.disable_tqdm, file=sys.stderr) as bar:
            result = await run(lambda _: bar.update(1))
        during = await poller.stop() if on else []
        after = await scrape(metrics_session, metrics_url) if on else None
    return result, summarize_server_metrics(before, after, during).to_dict()


async def benchmark(
    args: argparse.Namespace,
    samples: Workload,
    tokenizer: PreTrainedTokenizerBase | None,
) -> dict[str, Any]:
    """Run one serving benchmark against the server named by ``args``; return the result."""
    base_url, api_url = urls(args)
    counter: client.TokenCounter | None = None
    if tokenizer is not None:
        counter = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    async with (
        client.make_session(args.request_timeout) as session,
        client.open_transport(args.backend, session, api_url, args.request_timeout) as transport,
    ):
        model = await _model_name(session, base_url, args)
        send = partial(_send, client.BACKENDS[args.backend], transport, counter)
        run, firsts, num_requests = plan_run(args, samples, tokenizer, send, api_url, model)
        if args.ready_check_timeout_sec > 0:
            await _ready_check(send, firsts[0], args.ready_check_timeout_sec)
        await _warm_up(send, firsts, args.num_warmups, args.max_concurrency)
        run_result, server = await measure(args, run, num_requests, base_url)
    _warn_about(run_result.records, run_result.max_send_lag)
    result = build_result(
        args, model, run_result.records, run_result.duration, run_result.max_send_lag, server
    )
    if isinstance(run_result, ConversationRunResult):
        result.update(_multi_turn_keys(args, run_result, len(samples)))
    return result


def _multi_turn_keys(
    args: argparse.Namespace, run: ConversationRunResult, num_conversations: int
) -> dict[str, Any]:
    """Conversation count and per-turn statistics; with --save-detailed, where each request
    came from (conversation id, 0-based turn)."""
    out: dict[str, Any] = {
        "num_conversations": num_conversations,
        "turns": multi_turn.turn_stats(run.records, run.turn_indices),
    }
    if args.save_detailed:
        out["conversation_ids"] = run.conversation_ids
        out["turn_indices"] = run.turn_indices
    return out


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
    session: Any,  # the backend's transport (client.open_transport)
    counter: client.TokenCounter | None,
    inp: RequestInput,
) -> RequestRecord:
    return await func(session, inp, counter)


def resolve_backend(args: argparse.Namespace) -> None:
    """--backend default by dataset: multi_turn sends message lists, so it needs chat."""
    chat = canonical_name(args.dataset_name) == "multi_turn"
    if args.backend is None:
        args.backend = "openai-chat" if chat else "openai"
    elif chat and args.backend != "openai-chat":
        raise ValueError("--dataset-name multi_turn needs --backend openai-chat.")
    if args.backend == "grpc" and getattr(args, "grpc_port", None) is None:
        raise ValueError("--backend grpc needs --grpc-port (kvserve serve --grpc-port P).")
    if getattr(args, "priority_labels_only", False) and not getattr(args, "priority_mix", None):
        raise ValueError("--priority-labels-only labels the classes of --priority-mix; give both.")
    if getattr(args, "priority_mix", None):
        if chat:
            raise ValueError("--priority-mix applies to single requests, not multi_turn.")
        priority.parse_priority_mix(args.priority_mix)  # a bad spec fails before any request
    if getattr(args, "lora_modules", None):
        if chat:
            raise ValueError("--lora-modules applies to single requests, not multi_turn.")
        lora_mix.check_modules(args.lora_modules)


def prepare(args: argparse.Namespace) -> tuple[Workload, PreTrainedTokenizerBase]:
    """Validate options, load the tokenizer and build the dataset (or the conversations)."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be positive.")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be positive.")
    resolve_backend(args)
    options.apply_general_lengths(args)
    slo_from_args(args)  # fail on a malformed SLO before the dataset is built
    parse_percentiles(args.percentiles)
    tokenizer = load_tokenizer(args.tokenizer, args.model)
    args.tokenizer_id = getattr(tokenizer, "name_or_path", args.tokenizer)
    if canonical_name(args.dataset_name) == "multi_turn":
        return multi_turn.get_conversations(args, tokenizer), tokenizer
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
