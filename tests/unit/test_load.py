"""Load signals: parsing vLLM's /metrics, the scraper core, and load-aware scoring."""

from __future__ import annotations

import math
import random
import re
import time
from pathlib import Path

import pytest

from pdclient import PDConfigError
from pdclient.fleet import (
    Fetch,
    Fetched,
    LoadScraper,
    ScrapeSettings,
    ServerLoad,
    parse_metrics,
    server_url,
)
from pdclient.pools import BreakerSettings, EndpointPool, PeakEWMA
from pdclient.routing import LeastOutstanding, LoadAware, LoadSample, RouteRequest
from tests.clock import Clock

# The shape of vLLM 0.32's answer (vllm/v1/metrics/loggers.py; a real one is in
# data/vllm_0_32_metrics.txt): HELP and TYPE lines, labels model_name and engine,
# histograms and counters around the three gauges.
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


def test_reads_a_real_vllm_0_32_answer() -> None:
    text = (Path(__file__).parent / "data" / "vllm_0_32_metrics.txt").read_text()
    load = parse_metrics(text, model="smollm2")
    assert load is not None and (load.waiting, load.running) == (0.0, 1.0)
    assert load.kv_usage == pytest.approx(0.0055096418732781816)
    assert parse_metrics(text, model="other") is None


class _SampleSpy:
    """Stands in for the sample-line pattern, recording each line the parser ran it on."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.lines: list[str] = []

    def fullmatch(self, line: str) -> re.Match[str] | None:
        self.lines.append(line)
        return self.pattern.fullmatch(line)


def test_only_the_lines_of_the_families_it_reads_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real vLLM answer has ~450 sample lines (64 kB), of which 3 matter: matching every
    # one cost ~1.1 ms a scrape, twice a second per server.
    spy = _SampleSpy(
        re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?[ \t]+(?P<value>[^ \t]+)")
    )
    monkeypatch.setattr("pdclient.fleet._load._SAMPLE", spy)
    text = (Path(__file__).parent / "data" / "vllm_0_32_metrics.txt").read_text()
    load = parse_metrics(text, model="smollm2")
    assert load is not None and (load.waiting, load.running) == (0.0, 1.0)
    wanted = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    assert spy.lines and all(line.split("{")[0] in wanted for line in spy.lines), spy.lines


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


# -- the scraper core -------------------------------------------------------------------


def metrics(waiting: float, running: float, kv: float | None = None) -> str:
    text = f"vllm:num_requests_waiting {waiting}\nvllm:num_requests_running {running}\n"
    return text + (f"vllm:kv_cache_usage_perc {kv}\n" if kv is not None else "")


def make_pool(n: int = 3, clock: Clock | None = None) -> EndpointPool:
    urls = tuple(f"http://10.0.0.{i + 1}:8000/v1" for i in range(n))
    return EndpointPool("decode", urls, LeastOutstanding(), BreakerSettings(), clock or Clock(100.0))


def test_scraper_schedules_each_member_once_per_interval() -> None:
    pool = make_pool(2)
    scraper = LoadScraper(lambda: pool.endpoints, ScrapeSettings(interval=0.5, staleness=2.0, timeout=0.3))
    jobs = scraper.due(0.0)
    assert [(j.action.url, j.action.timeout) for j in jobs] == [  # type: ignore[union-attr]
        ("http://10.0.0.1:8000/metrics", 0.3),
        ("http://10.0.0.2:8000/metrics", 0.3),
    ]
    assert scraper.due(0.1) == [] and scraper.next_due() == float("inf"), "both in flight"
    scraper.apply(jobs[0], Fetched(200, metrics(1, 2)), 0.05)
    assert scraper.next_due() == 0.5
    assert scraper.due(0.6) == [jobs[0]], "the other is still pending"
    scraper.apply(jobs[1], Fetched(None, error="ConnectTimeout"), 0.6)
    assert [j.key for j in scraper.due(0.6)] == [pool.endpoints[1]]


def test_scraper_leaves_a_sample_with_this_process_in_flight_then() -> None:
    pool = make_pool(1)
    endpoint = pool.endpoints[0]
    endpoint.acquire()
    endpoint.acquire()
    scraper = LoadScraper(lambda: pool.endpoints, ScrapeSettings(staleness=2.0))
    (job,) = scraper.due(10.0)
    scraper.apply(job, Fetched(200, metrics(3, 4, 0.5)), 10.2)
    assert endpoint.load == LoadSample(3, 4, 0.5, taken_at=10.2, fresh_until=12.2, local_in_flight=2)
    assert endpoint.load.fresh(12.1) and not endpoint.load.fresh(12.2)


def test_failed_scrapes_keep_the_old_sample_to_go_stale_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    pool = make_pool(1)
    endpoint = pool.endpoints[0]
    scraper = LoadScraper(lambda: pool.endpoints, ScrapeSettings(interval=0.5, staleness=2.0), leg="decode")
    (job,) = scraper.due(0.0)
    scraper.apply(job, Fetched(200, metrics(0, 1)), 0.0)
    before = endpoint.load
    for t, outcome in [(0.5, Fetched(503, "down")), (1.0, Fetched(200, "<html>")), (1.5, Fetched(None, error="x"))]:
        (job,) = scraper.due(t)
        scraper.apply(job, outcome, t)
    assert endpoint.load is before and not before.fresh(2.0)
    warnings = [r for r in caplog.records if "no load signal" in r.getMessage()]
    assert len(warnings) == 1 and "HTTP 503" in warnings[0].getMessage()


def test_scraper_follows_membership_changes() -> None:
    pool = make_pool(2)
    scraper = LoadScraper(lambda: pool.endpoints)
    for job in scraper.due(0.0):
        scraper.apply(job, Fetched(200, metrics(0, 0)), 0.0)
    pool.set_members([("http://10.0.0.2:8000/v1", None), ("http://10.0.0.9:8000/v1", "vllm.test")])
    jobs = scraper.due(0.1)
    assert [j.action for j in jobs] == [Fetch("http://10.0.0.9:8000/metrics", 1.0, host="vllm.test")], (
        "a new member is scraped at once, with its DNS name"
    )
    for job in jobs + scraper.due(0.7):
        scraper.apply(job, Fetched(200, metrics(0, 0)), 0.7)
    assert {j.key for j in scraper.due(10.0)} == set(pool.endpoints), "the removed one is not visited"


# -- load-aware scoring -------------------------------------------------------------------


def sample(clock: Clock, waiting: float, running: float, kv: float | None = None, local: int = 0) -> LoadSample:
    return LoadSample(waiting, running, kv, taken_at=clock.now, fresh_until=clock.now + 2, local_in_flight=local)


REQUEST = RouteRequest("decode")


def test_load_aware_takes_the_servers_view_over_this_process() -> None:
    clock = Clock(100.0)
    a, b, c = make_pool(3, clock).endpoints
    a.load, b.load, c.load = sample(clock, 0, 9), sample(clock, 0, 2), sample(clock, 0, 5)
    for _ in range(2):
        b.acquire()  # this process's own calls on b since the scrape count too: 2 + 2 = 4
    policy = LoadAware(clock=clock, extrapolate=False)
    assert policy.scores([a, b, c]) == [9, 4, 5]
    assert policy.choose([a, b, c], REQUEST) is b
    b.acquire()
    b.acquire()
    assert policy.choose([a, b, c], REQUEST) is c, "6 > 5"
    assert LeastOutstanding().choose([a, b, c], REQUEST) is a, "least-outstanding sees only this process"


def test_calls_finished_since_the_scrape_lower_the_score() -> None:
    clock = Clock(100.0)
    (a,) = make_pool(1, clock).endpoints
    for _ in range(3):
        a.acquire()
    a.load = sample(clock, 1, 3, local=3)
    for _ in range(3):
        a.release(ok=True)
    policy = LoadAware(clock=clock, extrapolate=False)
    assert policy.scores([a]) == [1.0], "our 3 ended: the server holds 1 waiting"
    a.load = sample(clock, 0, 1, local=3)
    assert policy.scores([a]) == [0.0], "never below zero"


def test_calls_since_the_scrape_count_for_the_pools_other_clients_too() -> None:
    clock = Clock(100.0)
    a, b, c = make_pool(3, clock).endpoints
    # at the scrape the servers held 12 requests, 3 of them ours: each of ours stands for 4
    a.load, b.load, c.load = sample(clock, 0, 2, local=1), sample(clock, 1, 4, local=1), sample(clock, 0, 5, local=1)
    for e in (a, b, c):
        e.acquire()
    policy = LoadAware(clock=clock)
    assert policy.scores([a, b, c]) == [2, 5, 5]
    first = policy.choose([a, b, c], REQUEST)
    first.acquire()
    assert first is a and policy.scores([a, b, c]) == [6, 5, 5], "one more of ours: four more in all"
    assert policy.choose([a, b, c], REQUEST) in (b, c), "without extrapolation a (3) would win again: herding"
    assert LoadAware(clock=clock, extrapolate=False).choose([a, b, c], REQUEST) is a


def test_extrapolation_is_bounded() -> None:
    clock = Clock(100.0)
    a, b = make_pool(2, clock).endpoints
    a.load, b.load = sample(clock, 500, 500), sample(clock, 500, 500)  # none of it ours
    a.acquire()
    assert LoadAware(clock=clock).scores([a, b]) == [1064, 1000]


def test_weights() -> None:
    clock = Clock(100.0)
    a, b = make_pool(2, clock).endpoints
    a.load, b.load = sample(clock, 3, 0), sample(clock, 0, 5)
    assert LoadAware(clock=clock).choose([a, b], REQUEST) is a
    assert LoadAware(waiting_weight=2.0, clock=clock).choose([a, b], REQUEST) is b
    assert LoadAware(running_weight=0.5, clock=clock).choose([a, b], REQUEST) is b


def test_full_kv_caches_are_avoided_unless_all_are_full() -> None:
    clock = Clock(100.0)
    a, b, c = make_pool(3, clock).endpoints
    a.load, b.load, c.load = sample(clock, 0, 0, kv=0.95), sample(clock, 0, 7, kv=0.5), sample(clock, 0, 3, kv=None)
    policy = LoadAware(clock=clock)
    assert policy.choose([a, b, c], REQUEST) is c, "unknown KV usage is not full"
    c.load = sample(clock, 0, 3, kv=0.81)
    assert policy.choose([a, b, c], REQUEST) is b
    b.load = sample(clock, 0, 7, kv=0.99)
    assert policy.choose([a, b, c], REQUEST) is a, "all full: the least loaded of all"


def test_stale_or_missing_samples_mean_least_outstanding() -> None:
    clock = Clock(100.0)
    a, b = make_pool(2, clock).endpoints
    a.acquire()
    policy = LoadAware(clock=clock, extrapolate=False)
    assert policy.choose([a, b], REQUEST) is b and policy.scores([a, b]) is None, "no samples yet"
    a.load, b.load = sample(clock, 0, 0), sample(clock, 0, 50)
    assert policy.choose([a, b], REQUEST) is a
    clock.now += 1.9
    b.load = sample(clock, 0, 50)
    clock.now += 0.2
    assert policy.scores([a, b]) is None, "a's sample is 2.1 s old: stale"
    assert policy.choose([a, b], REQUEST) is b, "least outstanding: a has 1 of ours"
    assert policy.loads([a, b]) == [1.0, 0.0]


def test_ties_go_to_fewer_of_ours_first() -> None:
    clock = Clock(100.0)
    a, b, c = make_pool(3, clock).endpoints
    for e in (a, b, c):
        e.load = sample(clock, 0, 2, local=1)
        e.acquire()
    a.acquire()
    a.load = sample(clock, 0, 2, local=2)  # the same score as b and c, two of ours on it
    policy = LoadAware(clock=clock, rng=random.Random(3))
    assert {policy.choose([a, b, c], REQUEST).url for _ in range(30)} == {b.url, c.url}


def test_ties_are_spread() -> None:
    clock = Clock(100.0)
    endpoints = make_pool(3, clock).endpoints
    for e in endpoints:
        e.load = sample(clock, 0, 2)
    policy = LoadAware(clock=clock, rng=random.Random(1))
    assert {policy.choose(endpoints, REQUEST).url for _ in range(50)} == {e.url for e in endpoints}


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(PDConfigError):
        ScrapeSettings(interval=2.0, staleness=1.0)
    with pytest.raises(PDConfigError):
        LoadAware(kv_threshold=0)


# -- latency ------------------------------------------------------------------------------------


def test_peak_ewma_jumps_to_a_peak_and_forgives_slowly() -> None:
    clock = Clock(100.0)
    latency = PeakEWMA(tau=10.0, clock=clock)
    assert latency.estimate() is None
    latency.observe(40.0)
    assert latency.estimate() == 40.0
    clock.now += 0.1
    latency.observe(400.0)
    assert latency.estimate() == 400.0, "a peak replaces the estimate at once"
    clock.now += 0.1
    latency.observe(40.0)
    assert 390 < latency.estimate() < 400, "one fast answer 0.1 s later barely moves it"  # type: ignore[operator]
    clock.now += 30.0
    assert latency.estimate() < 400 * math.exp(-2.9), "it decays while nothing is observed"  # type: ignore[operator]
    latency.observe(40.0)
    assert latency.estimate() == 40.0, "a decayed estimate takes the next answer as its peak"


def test_latency_is_a_penalty_relative_to_the_pool_never_a_bonus() -> None:
    clock = Clock(100.0)
    a, b, c = make_pool(3, clock).endpoints
    for endpoint, ms in ((a, 30.0), (b, 40.0), (c, 160.0)):
        endpoint.latency.observe(ms)
    assert LoadAware.slowness([a, b, c]) == [1.0, 1.0, 4.0], "over the median (40), at least 1"
    a.load, b.load, c.load = sample(clock, 0, 6), sample(clock, 0, 6), sample(clock, 0, 1)
    policy = LoadAware(clock=clock, extrapolate=False)
    assert policy.scores([a, b, c]) == [6, 6, 7], "(1 + 1) x 4 - 1"
    assert policy.choose([a, b, c], REQUEST) in (a, b), "fewer requests, but 4x slower at them"
    assert LoadAware(clock=clock, extrapolate=False, latency=False).choose([a, b, c], REQUEST) is c


def test_latency_needs_two_estimates_to_compare() -> None:
    clock = Clock(100.0)
    a, b = make_pool(2, clock).endpoints
    a.latency.observe(500.0)
    assert LoadAware.slowness([a, b]) == [1.0, 1.0]


def test_a_whole_answer_feeds_its_endpoints_latency_per_piece() -> None:
    from pdclient.handoff import Leg

    pool = make_pool(1)

    class FakeCall:
        request = None

    leg = Leg(FakeCall(), "decode", pool)  # type: ignore[arg-type]
    leg.pick(RouteRequest("decode"))
    leg.sent_at = time.perf_counter() - 0.5
    leg.answered(10)
    estimate = pool.endpoints[0].latency.estimate()
    assert estimate is not None and 50 <= estimate < 60, "0.5 s over 10 reads"
