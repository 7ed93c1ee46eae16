"""Server-side counters from the Prometheus ``/metrics`` endpoint: preemptions, queue peaks and
the prefix-cache hit rate.

Client timings cannot show *why* a run was slow; the engine's own metrics can. We scrape
``/metrics`` before the run, every ``interval`` seconds during it (gauges such as the number of
running requests are instantaneous, so their peak needs polling) and after it. The same code
reads kvserve's names (``kvserve:num_preemptions_total``, ``kvserve:num_requests_running``,
``kvserve:num_requests_waiting``) and vLLM's (``vllm:...``). Polls miss a short peak: a
kvserve server counts its steps by batch size (the histogram
``kvserve:step_num_requests_running``), whose bucket deltas over the run give its peak batch
exactly (up to 16; the bucket's lower edge above), and its high-water mark
``kvserve:max_num_requests_running`` catches a peak above every earlier one. The
prefix cache's hit rate over the run is the hits delta over the queries delta of
``kvserve:prefix_cache_{queries,hits}_total`` (vLLM: ``vllm:prefix_cache_...``), both in
prompt tokens: a server-wide rate, so it covers exactly the measured requests only when nothing
else talks to the server. Anything missing or unparsable gives ``None`` and never fails the
benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("kvserve", "vllm")  # tried in this order


@dataclass
class ServerMetricsSummary:
    source: str | None = None  # "kvserve", "vllm", or None when no known metric was found
    num_preemptions: int | None = None  # counter delta over the run
    peak_num_requests_running: int | None = None
    peak_num_requests_waiting: int | None = None
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the cache (delta)
    prefix_cache_hits: int | None = None  # of those, tokens found cached (delta)
    prefix_cache_hit_rate: float | None = None  # hits / queries; None when nothing was queried
    # Speculative decoding (vLLM's spec_decode_* counters, deltas over the run): proposals
    # verified, their tokens, and how many were accepted
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_acceptance_rate: float | None = None  # accepted / proposed tokens
    # tokens a verified request gets per step: 1 + accepted / drafts (vLLM's mean acceptance
    # length, which counts the target's own token)
    spec_decode_mean_acceptance_length: float | None = None
    num_scrapes: int = 0  # scrapes that parsed, before + during + after

    def to_dict(self) -> dict[str, Any]:
        """Result-file keys; source and scrape count get a ``server_metrics_`` prefix."""
        out = asdict(self)
        out["server_metrics_source"] = out.pop("source")
        out["server_metrics_scrapes"] = out.pop("num_scrapes")
        return out


def parse_samples(text: str | None) -> dict[str, float] | None:
    """Sample name -> value, summed over label sets (engines, models); a histogram bucket is
    keyed ``NAME_bucket{le}`` per bound (``le`` as a float's text). None if unparsable."""
    if not text:
        return None
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                if "le" in sample.labels:
                    key = f"{key}{{{float(sample.labels['le'])}}}"
                values[key] = values.get(key, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError):  # the parser's errors on malformed text
        return None
    return values


def _lookup(values: dict[str, float] | None, names: Sequence[str]) -> float | None:
    if values is None:
        return None
    for name in names:
        if name in values:
            return values[name]
    return None


def _names(prefix: str) -> dict[str, tuple[str, ...]]:
    # A counter is exposed as NAME_total; untyped exporters may drop the suffix.
    return {
        "preemptions": (f"{prefix}:num_preemptions_total", f"{prefix}:num_preemptions"),
        "running": (f"{prefix}:num_requests_running",),
        "waiting": (f"{prefix}:num_requests_waiting",),
        # kvserve's own high-water mark of the running batch since the server started.
        "running_max": (f"{prefix}:max_num_requests_running",),
        "cache_queries": (f"{prefix}:prefix_cache_queries_total", f"{prefix}:prefix_cache_queries"),
        "cache_hits": (f"{prefix}:prefix_cache_hits_total", f"{prefix}:prefix_cache_hits"),
        **{
            key: (f"{prefix}:{key}_total", f"{prefix}:{key}")
            for key in (
                "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens",
            )
        },
    }


def _counter_delta(
    first: dict[str, float] | None, last: dict[str, float] | None, names: Sequence[str]
) -> int | None:
    """``last - first`` of a counter; None when either side lacks it or it went down (a server
    restarted mid-run: no honest delta)."""
    start, end = _lookup(first, names), _lookup(last, names)
    if start is None or end is None or end < start:
        return None
    return int(end - start)


def _peak(scrapes: Sequence[dict[str, float] | None], names: Sequence[str]) -> int | None:
    seen = [v for v in (_lookup(s, names) for s in scrapes) if v is not None]
    return int(max(seen)) if seen else None


def histogram_floor(
    first: dict[str, float] | None, last: dict[str, float] | None, name: str
) -> int | None:
    """The largest value a histogram of integers surely saw between two scrapes: the lower
    edge (previous bound + 1) of the highest bucket whose count rose; None when the
    histogram is absent from either scrape or saw nothing new."""
    if first is None or last is None:
        return None
    prefix = f"{name}_bucket{{"
    bounds = sorted(float(k[len(prefix) : -1]) for k in last if k.startswith(prefix))
    floor, below, prev = None, 0.0, 0.0
    for le in bounds:
        key = f"{prefix}{le}}}"
        if key not in first:
            return None
        rose = (last[key] - first[key]) - below  # new observations in (prev, le]
        if rose > 0:
            floor = int(prev) + 1
        below, prev = last[key] - first[key], le
    return floor


def summarize_server_metrics(
    before: str | None, after: str | None, during: Sequence[str] = ()
) -> ServerMetricsSummary:
    """Preemptions during the run (``after - before``) and peak running/waiting requests over
    all scrapes. Pure: takes the scraped texts, returns None fields for what is absent."""
    first, last = parse_samples(before), parse_samples(after)
    polled = [parse_samples(t) for t in during]
    scrapes = [first, *polled, last]
    parsed = [s for s in scrapes if s is not None]
    summary = ServerMetricsSummary(num_scrapes=len(parsed))
    for prefix in PREFIXES:
        names = _names(prefix)
        if not any(_lookup(s, n) is not None for s in parsed for n in names.values()):
            continue
        summary.source = prefix
        summary.num_preemptions = _counter_delta(first, last, names["preemptions"])
        _add_prefix_cache(summary, first, last, names)
        _add_spec_decode(summary, first, last, names)
        summary.peak_num_requests_running = _peak(scrapes, names["running"])
        summary.peak_num_requests_waiting = _peak(scrapes, names["waiting"])
        # Polling can miss a short peak; the steps-by-batch histogram and a high-water mark
        # that rose during the run cannot.
        floor = histogram_floor(first, last, f"{prefix}:step_num_requests_running")
        if floor is not None:
            seen = summary.peak_num_requests_running or 0
            summary.peak_num_requests_running = max(seen, floor)
        hw_start = _lookup(first, names["running_max"])
        hw_end = _lookup(last, names["running_max"])
        if hw_start is not None and hw_end is not None and hw_end > hw_start:
            seen = summary.peak_num_requests_running or 0
            summary.peak_num_requests_running = max(seen, int(hw_end))
        break
    return summary


def _add_prefix_cache(
    summary: ServerMetricsSummary,
    first: dict[str, float] | None,
    last: dict[str, float] | None,
    names: dict[str, tuple[str, ...]],
) -> None:
    queries = _counter_delta(first, last, names["cache_queries"])
    hits = _counter_delta(first, last, names["cache_hits"])
    summary.prefix_cache_queries, summary.prefix_cache_hits = queries, hits
    # 0/0 is no evidence either way (caching off, or no request admitted): not a 0% rate.
    if queries and hits is not None:
        summary.prefix_cache_hit_rate = hits / queries


def _add_spec_decode(
    summary: ServerMetricsSummary,
    first: dict[str, float] | None,
    last: dict[str, float] | None,
    names: dict[str, tuple[str, ...]],
) -> None:
    drafts = _counter_delta(first, last, names["spec_decode_num_drafts"])
    tokens = _counter_delta(first, last, names["spec_decode_num_draft_tokens"])
    accepted = _counter_delta(first, last, names["spec_decode_num_accepted_tokens"])
    summary.spec_decode_num_drafts = drafts
    summary.spec_decode_num_draft_tokens = tokens
    summary.spec_decode_num_accepted_tokens = accepted
    if tokens and accepted is not None:
        summary.spec_decode_acceptance_rate = accepted / tokens
    if drafts and accepted is not None:
        summary.spec_decode_mean_acceptance_length = 1 + accepted / drafts


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> str | None:
    """GET ``url`` (a ``/metrics`` endpoint); None on any failure."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


class MetricsPoller:
    """Background task scraping ``url`` every ``interval`` seconds until stopped."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float = 0.5) -> None:
        self.session, self.url, self.interval = session, url, interval
        self.texts: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            text = await scrape(self.session, self.url)
            if text is not None:
                self.texts.append(text)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[str]:
        """Cancel the task and return every scrape it collected."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.texts
