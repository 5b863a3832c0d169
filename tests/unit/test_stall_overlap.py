"""benchmarks/stall_overlap.py's arithmetic: which request is which route, and how much of a
stream's time a decode-only turn beside it took."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import stall_overlap as so


def request(start: float, ttft: float, latency: float, tokens: int = 41) -> dict[str, Any]:
    return {"start_time_ms": start, "ttft_ms": ttft, "latency_ms": latency, "output_num_tokens": tokens}


def test_a_request_gets_the_route_of_the_proxys_call_with_its_times(tmp_path: Path) -> None:
    log = tmp_path / "pdclient-auto.log"
    log.write_text(
        "2026-12-07 INFO pdclient.serve [1]: call outcome=decode_only ttft_ms=400.0 total_ms=2400.0\n"
        "2026-12-07 INFO uvicorn.error [1]: Started server process [1]\n"
        "2026-12-07 INFO pdclient.serve [1]: call outcome=disaggregated ttft_ms=1000.0 total_ms=3000.0\n"
    )
    calls = so.proxy_calls(log)
    stats = [request(0, 1010, 3005), request(50, 405, 2410), request(60, 5000, 9000)]
    routes = [(r["ttft_ms"], route) for r, route in so.matched(stats, calls)]
    assert routes == [(1010, "disaggregated"), (405, "decode_only")]  # the third matches nothing


def test_a_stream_beside_a_decode_only_turn_is_charged_what_it_lost_beyond_its_tokens() -> None:
    clean = request(0, 100, 100 + 40 * 40)  # 40 ms a token
    turn = request(2000, 500, 500 + 40 * 40)  # holds the decode from 2,000 to 2,500 ms
    # Streaming from 1,800 ms, through the whole turn: it took its 40 gaps of 40 ms, and 500 ms more.
    beside = request(1700, 100, 100 + 40 * 40 + 500)
    points = so.run_points([(clean, "disaggregated"), (turn, "decode_only"), (beside, "disaggregated")])
    assert points[0] == (0.0, 0.0)
    assert points[2] == (500.0, 500.0)


def test_an_arms_line_gives_what_its_streams_beside_decode_only_turns_overlapped_and_lost() -> None:
    points = [(0.0, 5.0), *((float(100 * i), float(50 * i)) for i in range(1, 11))]
    line = so.arm_line("pdclient-auto", points)
    assert line == (
        "pdclient-auto: 11 requests, 10 beside decode-only turns; ms overlapped p50 / p90 / most "
        "550 / 910 / 1000, lost 275 / 455 / 500"
    )
    assert so.arm_line("pdclient-always", [(0.0, 3.0)]) == "pdclient-always: 1 requests, none beside a decode-only turn"
