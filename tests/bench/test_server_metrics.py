"""Prometheus parsing of kvserve: and vllm: metric names; absent metrics give None."""

from __future__ import annotations

from kvserve.bench.server_metrics import parse_samples, summarize_server_metrics


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
