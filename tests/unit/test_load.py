"""Load signals: parsing vLLM's /metrics, the scraper core, and load-aware scoring."""

from __future__ import annotations

import pytest

from pdclient._load import ServerLoad, parse_metrics, server_url

# The shape of vLLM 0.32's answer (vllm/v1/metrics/loggers.py): HELP and TYPE lines,
# labels model_name and engine, histograms and counters around the three gauges.
VLLM_0_32 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 4096.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="smol"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smol"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"} 7.0
"""


def test_reads_vllm_0_32() -> None:
    assert parse_metrics(VLLM_0_32) == ServerLoad(waiting=2.0, running=3.0, kv_usage=0.25)
    assert parse_metrics(VLLM_0_32, model="smol") == ServerLoad(waiting=2.0, running=3.0, kv_usage=0.25)


def test_sums_engines_and_averages_their_kv_usage() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 4
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
"""
    load = parse_metrics(text)
    assert load is not None and (load.waiting, load.running) == (1, 7)
    assert load.kv_usage == pytest.approx(0.4)


def test_model_filter_keeps_that_models_label_sets() -> None:
    text = """\
vllm:num_requests_running{model_name="a"} 5
vllm:num_requests_running{model_name="b"} 1
vllm:num_requests_waiting{model_name="a"} 2
vllm:num_requests_waiting{model_name="b"} 0
"""
    assert parse_metrics(text, model="b") == ServerLoad(0, 1, None)
    assert parse_metrics(text) == ServerLoad(2, 6, None), "no model given: the server's whole load"
    assert parse_metrics(text, model="c") is None


def test_older_vllm_kv_metric_and_unlabelled_samples() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0 1700000000000\nvllm:gpu_cache_usage_perc 0.5\n"
    assert parse_metrics(text) == ServerLoad(0, 1, 0.5)
    both = text + "vllm:kv_cache_usage_perc 0.7\n"
    assert parse_metrics(both) == ServerLoad(0, 1, 0.7), "the current name wins"


def test_label_values_with_quotes_braces_and_escapes() -> None:
    text = r"""vllm:num_requests_running{model_name="we\"ird} {name}, x=\"1\"",engine="0"} 4
vllm:num_requests_waiting{model_name="we\"ird} {name}, x=\"1\"",engine="0"} 1
"""
    assert parse_metrics(text, model='we"ird} {name}, x="1"') == ServerLoad(1, 4, None)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage\n\x00\xff not metrics at all {{{",
        "<html><body>502 Bad Gateway</body></html>",
        "vllm:num_requests_running 3\n",  # waiting missing
        "vllm:num_requests_waiting 3\n",  # running missing
        'vllm:num_requests_running{ 3\nvllm:num_requests_waiting{model_name="x} 1\n',  # broken labels
        "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n",
        "vllm:num_requests_running -1\nvllm:num_requests_waiting 1\n",
        "vllm:num_requests_running +Inf\nvllm:num_requests_waiting 1\n",
        "vllm:num_requests_running three\nvllm:num_requests_waiting 1\n",
        "vllm:num_requests_running_other 3\nvllm:num_requests_waiting_by_reason 1\n",  # names that only start alike
    ],
)
def test_missing_or_garbage_gives_none(text: str) -> None:
    assert parse_metrics(text) is None


def test_bad_kv_values_are_dropped_not_fatal() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 7.5\n"
    assert parse_metrics(text) == ServerLoad(0, 1, None)


def test_a_bad_line_among_good_ones_is_skipped() -> None:
    text = VLLM_0_32.replace(
        'vllm:num_requests_running{engine="0",model_name="smol"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="smol"} 3.0\nvllm:num_requests_running{engine="1" oops 9',
    )
    assert parse_metrics(text) == ServerLoad(2.0, 3.0, 0.25)


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://10.0.0.1:8000/v1", "http://10.0.0.1:8000/metrics"),
        ("http://10.0.0.1:8000", "http://10.0.0.1:8000/metrics"),
        ("https://gw.example/models/llama/v1", "https://gw.example/models/llama/metrics"),
    ],
)
def test_metrics_live_beside_v1(base: str, expected: str) -> None:
    assert server_url(base, "/metrics") == expected
