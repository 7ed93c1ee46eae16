"""In-process load driver: the engine alone, fed at the bench lab's arrival times.

``run_arrivals`` plays the part of ``kvserve bench serve`` without a server: request ``i`` is
handed to ``LLMEngine.add_request`` once ``offsets[i]`` seconds (from the bench lab's
:func:`kvserve.bench.arrivals.arrival_times`) have passed, the engine is stepped in between,
and every request ends up as a :class:`kvserve.bench.client.RequestRecord`, so that
:func:`kvserve.bench.metrics.calculate_metrics` computes exactly the metrics it computes for
an HTTP run.

Timing follows the HTTP client's definitions, with the engine as the "server":

* a request's clock starts at its *scheduled* arrival time; a request that arrives while a step
  runs is added when the step returns, and that wait counts in its TTFT (a server's engine
  thread also picks new requests up only between steps);
* TTFT ends at the step that produced the first token, ITL is the gap between consecutive steps
  that produced tokens for the request, E2E latency ends at its last token;
* token counts are the engine's own (prompt ids and generated ids), never estimates;
* ``duration`` runs from the start to the last completion, as in the lab's runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.client import RequestRecord
from kvserve.bench.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, calculate_metrics
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.sampling_params import SamplingParams


@dataclass
class DriverRequest:
    """One request for the engine: its prompt (text, token ids or vLLM's dict) and params."""

    prompt: PromptType
    params: SamplingParams
    expected_output_len: int | None = None


@dataclass
class DriverResult:
    """Per-request records in input order, the run's duration and engine counters."""

    records: list[RequestRecord]
    duration: float  # seconds from the first scheduled arrival to the last completion
    num_preemptions: int  # preemptions during the run (engine counter delta)
    num_steps: int  # engine steps during the run
    peak_num_running: int  # most requests running after one schedule
    peak_num_waiting: int  # most requests waiting after one step
    max_add_lag: float  # worst delay of an add_request behind its scheduled arrival
    step_time: dict[str, float] = field(default_factory=dict)  # run's step-time breakdown, s
    engine_threads: int = 0  # torch threads of the engine's model (its execution paths)

    def metrics(self, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> BenchmarkMetrics:
        """The bench lab's metrics over this run's records."""
        return calculate_metrics(self.records, self.duration, percentiles)


def _prompt_len(engine: LLMEngine, prompt: PromptType) -> int:
    return len(engine.processor.tokenize_prompt(prompt)[1])


def warm_up(engine: LLMEngine, prompt: PromptType, n: int = 1, max_tokens: int = 4) -> None:
    """``n`` short uncounted requests (first-call costs of torch kernels and allocators)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"warmup-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_arrivals(
    engine: LLMEngine,
    requests: Sequence[DriverRequest],
    offsets: Sequence[float],
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> DriverResult:
    """Feed ``requests[i]`` to ``engine`` at ``offsets[i]`` s after the start; step it to the end.

    The engine must be idle on entry. A request the engine rejects (``ValueError`` from
    ``add_request``: too long, can never fit the KV cache) becomes a failed record, as an
    HTTP 400 would.
    """
    if len(requests) != len(offsets):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} arrival offsets.")
    if engine.has_unfinished_requests():
        raise ValueError("the engine still has requests; run_arrivals needs an idle engine.")
    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    records = [
        RequestRecord(expected_output_len=r.expected_output_len, output_tokens_source="engine")
        for r in requests
    ]
    seen_tokens = [0] * len(requests)
    last_token = [0.0] * len(requests)
    before = engine.stats()
    step_before = dict(before["step_time"])
    peak_running = peak_waiting = 0
    max_lag = 0.0
    start = clock()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = clock()
        while nxt < len(order) and start + offsets[order[nxt]] <= now:
            i = order[nxt]
            nxt += 1
            rec = records[i]
            rec.start_time = start + offsets[i]
            max_lag = max(max_lag, now - rec.start_time)
            try:
                rec.prompt_len = _prompt_len(engine, requests[i].prompt)
                engine.add_request(str(i), requests[i].prompt, requests[i].params)
            except ValueError as e:
                rec.error = str(e)
        if not engine.has_unfinished_requests():
            if nxt < len(order):
                sleep(max(0.0, start + offsets[order[nxt]] - clock()))
            continue
        outputs = engine.step()
        t = clock()
        stats = engine.stats()
        peak_running = max(peak_running, int(stats["num_running"]))
        peak_waiting = max(peak_waiting, int(stats["num_waiting"]))
        for out in outputs:
            i = int(out.request_id)
            rec, comp = records[i], out.outputs[0]
            if len(comp.token_ids) > seen_tokens[i]:
                if seen_tokens[i] == 0:
                    rec.ttft = t - rec.start_time
                else:
                    rec.itl.append(t - last_token[i])
                last_token[i] = t
                seen_tokens[i] = len(comp.token_ids)
            if out.finished:
                rec.success = comp.finish_reason != "abort"
                rec.output_tokens = len(comp.token_ids)
                rec.latency = last_token[i] - rec.start_time
                rec.generated_text = comp.text
                rec.finish_reason = comp.finish_reason
    duration = clock() - start
    after = engine.stats()
    step_time = {
        k: float(v) - float(step_before.get(k, 0.0))
        for k, v in after["step_time"].items()
        if isinstance(v, (int, float))
    }
    return DriverResult(
        records=records,
        duration=duration,
        num_preemptions=int(after["num_preemptions"]) - int(before["num_preemptions"]),
        num_steps=int(after["num_steps"]) - int(before["num_steps"]),
        peak_num_running=peak_running,
        peak_num_waiting=peak_waiting,
        max_add_lag=max_lag,
        step_time=step_time,
        engine_threads=engine.execution_paths.num_threads,
    )


def result_dict(result: DriverResult) -> dict[str, Any]:
    """The lab's metric keys plus the driver's engine counters (JSON-ready)."""
    out: dict[str, Any] = result.metrics().to_dict()
    out.update(
        num_preemptions=result.num_preemptions,
        num_steps=result.num_steps,
        peak_num_requests_running=result.peak_num_running,
        peak_num_requests_waiting=result.peak_num_waiting,
        max_send_lag_s=result.max_add_lag,
        step_time_s=result.step_time,
        engine_threads=result.engine_threads,
        output_lens=[r.output_tokens for r in result.records],
        finish_reasons=[r.finish_reason for r in result.records],
    )
    return out
