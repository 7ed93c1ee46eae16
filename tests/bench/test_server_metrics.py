"""Prometheus parsing of kvserve: and vllm: metric names; absent metrics give None."""

from __future__ import annotations

from kvserve.bench.server_metrics import histogram_floor, parse_samples, summarize_server_metrics


def _kvserve(preemptions: float, running: float, waiting: float) -> str:
    return f"""# HELP kvserve:num_preemptions Preemptions so far.
# TYPE kvserve:num_preemptions counter
kvserve:num_preemptions_total {preemptions}
# HELP kvserve:num_requests_running Requests in the running batch.
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running {running}
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting {waiting}
# TYPE process_cpu_seconds counter
process_cpu_seconds_total 12.5
"""


def _vllm(preemptions: float, running: float, waiting: float) -> str:
    # vLLM labels its metrics per model and engine; two engines are summed.
    return f"""# HELP vllm:num_preemptions_total Cumulative number of preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}
vllm:num_preemptions_total{{engine="1",model_name="m"}} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_running{{engine="1",model_name="m"}} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
"""


def test_kvserve_names() -> None:
    during = [_kvserve(3, 8, 5), _kvserve(6, 4, 12), "garbage {{{ not prometheus"]
    s = summarize_server_metrics(_kvserve(2, 0, 0), _kvserve(9, 0, 0), during)
    assert s.source == "kvserve"
    assert s.num_preemptions == 7
    assert (s.peak_num_requests_running, s.peak_num_requests_waiting) == (8, 12)
    assert s.num_scrapes == 4  # the garbage scrape is skipped, not fatal
    d = s.to_dict()
    assert d["server_metrics_source"] == "kvserve" and d["num_preemptions"] == 7


def test_vllm_names_with_labels() -> None:
    s = summarize_server_metrics(_vllm(10, 0, 0), _vllm(15, 2, 0), [_vllm(12, 30, 7)])
    assert s.source == "vllm"
    assert s.num_preemptions == 5  # (15 + 1) - (10 + 1)
    assert (s.peak_num_requests_running, s.peak_num_requests_waiting) == (30, 7)


def test_absent_metrics_are_none() -> None:
    s = summarize_server_metrics(None, None)
    assert (s.source, s.num_preemptions, s.peak_num_requests_running) == (None, None, None)
    other = "# TYPE http_requests counter\nhttp_requests_total 5\n"
    s = summarize_server_metrics(other, other, [other])
    assert s.source is None and s.num_preemptions is None and s.num_scrapes == 3
    # Gauges without the counter: peaks known, preemptions not.
    gauges_only = "kvserve:num_requests_running 3\n"
    s = summarize_server_metrics(gauges_only, gauges_only)
    assert (s.source, s.num_preemptions, s.peak_num_requests_running) == ("kvserve", None, 3)
    assert s.peak_num_requests_waiting is None


def test_counter_reset_or_missing_before_gives_none() -> None:
    assert summarize_server_metrics(_kvserve(9, 0, 0), _kvserve(2, 0, 0)).num_preemptions is None
    assert summarize_server_metrics(None, _kvserve(2, 0, 0)).num_preemptions is None


def test_parse_samples_sums_label_sets() -> None:
    values = parse_samples(_vllm(4, 1, 2))
    assert values is not None
    assert values["vllm:num_preemptions_total"] == 5.0
    assert parse_samples("") is None


def test_kvserve_high_water_mark_catches_missed_peak() -> None:
    # Polls saw at most 2 running, but the server's high-water mark rose from 3 to 6.
    hw = "# TYPE kvserve:max_num_requests_running gauge\nkvserve:max_num_requests_running {}\n"
    before, after = _kvserve(0, 0, 0) + hw.format(3), _kvserve(0, 0, 0) + hw.format(6)
    s = summarize_server_metrics(before, after, [_kvserve(0, 2, 0) + hw.format(6)])
    assert s.peak_num_requests_running == 6
    # Unchanged mark: the run did not exceed the old peak, so only the polls count.
    s = summarize_server_metrics(before, before, [_kvserve(0, 2, 0) + hw.format(3)])
    assert s.peak_num_requests_running == 2


def _cache(prefix: str, queries: float, hits: float, labels: str = "") -> str:
    return (
        f"# TYPE {prefix}:prefix_cache_queries counter\n"
        f"{prefix}:prefix_cache_queries_total{labels} {queries}\n"
        f"# TYPE {prefix}:prefix_cache_hits counter\n"
        f"{prefix}:prefix_cache_hits_total{labels} {hits}\n"
    )


def test_prefix_cache_hit_rate_is_the_run_delta() -> None:
    # Before the run the server had answered other requests: 100 queried, 20 hit.
    before = _kvserve(0, 0, 0) + _cache("kvserve", 100, 20)
    after = _kvserve(0, 0, 0) + _cache("kvserve", 1100, 770)
    s = summarize_server_metrics(before, after)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (1000, 750)
    assert s.prefix_cache_hit_rate == 0.75  # not 770 / 1100
    d = s.to_dict()
    assert (d["prefix_cache_queries"], d["prefix_cache_hits"]) == (1000, 750)
    assert d["prefix_cache_hit_rate"] == 0.75


def test_prefix_cache_hit_rate_vllm_names_summed_over_engines() -> None:
    lab0, lab1 = '{engine="0",model_name="m"}', '{engine="1",model_name="m"}'
    before = _vllm(0, 0, 0) + _cache("vllm", 40, 8, lab0) + _cache("vllm", 60, 2, lab1)
    after = _vllm(0, 0, 0) + _cache("vllm", 240, 108, lab0) + _cache("vllm", 460, 402, lab1)
    s = summarize_server_metrics(before, after)
    assert s.source == "vllm"
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (600, 500)  # 700-100, 510-10
    assert s.prefix_cache_hit_rate == 500 / 600


def test_prefix_cache_without_counters_queries_or_with_a_reset() -> None:
    plain = summarize_server_metrics(_kvserve(0, 0, 0), _kvserve(0, 0, 0))
    assert (plain.prefix_cache_queries, plain.prefix_cache_hits) == (None, None)
    assert plain.prefix_cache_hit_rate is None
    # Nothing queried during the run: 0 tokens each, but 0/0 is no rate.
    idle = summarize_server_metrics(_cache("kvserve", 50, 5), _cache("kvserve", 50, 5))
    assert (idle.source, idle.prefix_cache_queries, idle.prefix_cache_hits) == ("kvserve", 0, 0)
    assert idle.prefix_cache_hit_rate is None
    # Caching off: queries counted, never a hit: a real 0% rate.
    off = summarize_server_metrics(_cache("kvserve", 0, 0), _cache("kvserve", 300, 0))
    assert off.prefix_cache_hit_rate == 0.0
    # The server restarted between the scrapes: no honest delta.
    reset = summarize_server_metrics(_cache("kvserve", 500, 400), _cache("kvserve", 30, 10))
    assert (reset.prefix_cache_queries, reset.prefix_cache_hit_rate) == (None, None)
    # Untyped exporters without the _total suffix are read too.
    bare = "kvserve:prefix_cache_queries {}\nkvserve:prefix_cache_hits {}\n"
    s = summarize_server_metrics(bare.format(10, 0), bare.format(210, 50))
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.prefix_cache_hit_rate) == (
        200,
        50,
        0.25,
    )


def _spec(prefix: str, drafts: int, tokens: int, accepted: int) -> str:
    lines = []
    for key, value in (("num_drafts", drafts), ("num_draft_tokens", tokens),
                       ("num_accepted_tokens", accepted)):  # fmt: skip
        lines += [f"# TYPE {prefix}:spec_decode_{key} counter",
                  f"{prefix}:spec_decode_{key}_total {value}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_spec_decode_acceptance_over_the_run() -> None:
    for prefix, make in (("kvserve", _kvserve), ("vllm", _vllm)):
        before = make(0, 0, 0) + _spec(prefix, 10, 40, 20)
        after = make(0, 0, 0) + _spec(prefix, 110, 440, 320)
        s = summarize_server_metrics(before, after)
        assert (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens) == (100, 400)
        assert s.spec_decode_num_accepted_tokens == 300
        assert s.spec_decode_acceptance_rate == 0.75
        assert s.spec_decode_mean_acceptance_length == 4.0  # 1 + 300 / 100
    plain = summarize_server_metrics(_kvserve(0, 0, 0), _kvserve(0, 0, 0))
    assert plain.spec_decode_acceptance_rate is None is plain.spec_decode_num_drafts


def test_report_prints_spec_decode_rows() -> None:
    from kvserve.bench.report import format_summary

    s = summarize_server_metrics(_kvserve(0, 0, 0) + _spec("kvserve", 0, 0, 0),
                                 _kvserve(0, 0, 0) + _spec("kvserve", 4, 16, 6))  # fmt: skip
    result = {"completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1,
              "total_output_tokens": 10, "request_throughput": 1.0, "output_throughput": 10.0,
              "total_token_throughput": 11.0, **s.to_dict()}  # fmt: skip
    text = format_summary(result, ())
    assert "Spec decode acceptance rate (%):" in text and "37.50" in text
    assert "Spec decode mean acceptance length:" in text and "2.50" in text


def _steps(counts: dict[float, int]) -> str:
    """A ``kvserve:step_num_requests_running`` histogram with cumulative ``counts`` per bound
    (two engines' label sets, the second all zero: parse_samples sums them)."""
    lines = ["# TYPE kvserve:step_num_requests_running histogram"]
    for engine, scale in (("0", 1), ("1", 0)):
        for le, n in counts.items():
            bound = "+Inf" if le == float("inf") else str(le)
            lines.append(
                f'kvserve:step_num_requests_running_bucket{{engine="{engine}",le="{bound}"}} '
                f"{n * scale}"
            )
    return "\n".join(lines) + "\n"


def test_steps_histogram_gives_the_exact_peak_that_polls_missed() -> None:
    inf = float("inf")
    before = _kvserve(0, 0, 0) + _steps({1.0: 10, 2.0: 14, 3.0: 14, 24.0: 20, inf: 20})
    # This run: 3 more steps of 1 request and 2 of 2; nothing at 3 or above.
    after = _kvserve(0, 0, 0) + _steps({1.0: 13, 2.0: 19, 3.0: 19, 24.0: 25, inf: 25})
    assert (
        histogram_floor(
            parse_samples(before), parse_samples(after), "kvserve:step_num_requests_running"
        )
        == 2
    )
    s = summarize_server_metrics(before, after, [_kvserve(0, 0, 0)] * 3)
    assert s.peak_num_requests_running == 2
    # A step of 17..24 requests: the bucket's lower edge is what is sure.
    later = _kvserve(0, 0, 0) + _steps({1.0: 13, 2.0: 19, 3.0: 19, 24.0: 26, inf: 26})
    assert summarize_server_metrics(after, later).peak_num_requests_running == 4
    # Nothing ran, or the histogram is missing on one side: no evidence from it.
    assert (
        histogram_floor(
            parse_samples(after), parse_samples(after), "kvserve:step_num_requests_running"
        )
        is None
    )
    assert (
        histogram_floor(
            parse_samples(_kvserve(0, 0, 0)),
            parse_samples(after),
            "kvserve:step_num_requests_running",
        )
        is None
    )
