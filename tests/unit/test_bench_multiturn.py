"""benchmarks/bench_multiturn.py's own arithmetic: the generator's config, the text rotation
that keeps runs from sharing prefixes, and what it reads from the tool's and servers' output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

# The benchmark reads the servers' /metrics with prometheus-client, which the openai 2.x
# tier's venv (pdclient's own dependencies only) does not have.
pytest.importorskip("prometheus_client")

import bench_multiturn as mt


def test_the_generator_config_is_the_tools_format_with_the_workloads_sizes() -> None:
    config = mt.generator_config(mt.WORKLOADS["short"], "/tmp/text.txt", conversations=16)
    assert config["filetype"] == "generate_conversations"
    assert config["num_conversations"] == 16
    assert config["text_files"] == ["/tmp/text.txt"]
    inputs, outputs = config["prompt_input"], config["prompt_output"]
    # 4 user turns, each with its answer: the tool counts both.
    assert inputs["num_turns"] == {"distribution": "constant", "value": 8}
    assert inputs["prefix_num_tokens"] == {"distribution": "constant", "value": 600}
    assert inputs["common_prefix_num_tokens"] == {"distribution": "constant", "value": 0}
    assert inputs["num_tokens"] == {"distribution": "constant", "value": 120}
    assert outputs["num_tokens"] == {"distribution": "constant", "value": 40}
    assert mt.generator_config(mt.WORKLOADS["long"], "t", 4)["prompt_input"]["num_tokens"]["value"] == 1000
    tool_loop = mt.generator_config(mt.WORKLOADS["tool-loop"], "t", 4)
    assert tool_loop["prompt_input"]["num_turns"]["value"] == 12
    assert tool_loop["prompt_output"]["num_tokens"]["value"] == 80


def test_each_run_reads_the_text_from_its_own_offset() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    rotated = [mt.rotated_text(text, run, runs=5) for run in range(5)]
    assert rotated[0] == text
    assert all(len(r) == len(text) and sorted(r) == sorted(text) for r in rotated)
    assert len({r[:50] for r in rotated}) == 5
    with pytest.raises(ValueError, match="run 5 of 5"):
        mt.rotated_text(text, 5, runs=5)


def _stat(turns: int, ttft: float, tpot: float = 10.0, latency: float = 500.0) -> dict[str, object]:
    return {"ttft_ms": ttft, "tpot_ms": tpot, "latency_ms": latency, "input_num_turns": turns}


def test_the_run_summary_reports_follow_up_turns_apart() -> None:
    stats = [_stat(1, 1000.0), _stat(1, 1200.0), _stat(3, 300.0), _stat(5, 500.0), _stat(7, 400.0)]
    summary = mt.run_summary(stats)
    assert summary["requests"] == 5
    assert summary["ttft_p50_ms"] == 500.0
    assert summary["first_turn_ttft_p50_ms"] == 1100.0
    assert summary["follow_up_ttft_p50_ms"] == 400.0
    assert summary["first_turn_ttft_p90_ms"] == pytest.approx(1180.0)
    assert summary["follow_up_ttft_p90_ms"] == pytest.approx(480.0)
    assert summary["tpot_p50_ms"] == 10.0
    assert summary["latency_p50_ms"] == 500.0
    assert summary["ttft_p99_ms"] == pytest.approx(1192.0)


def test_the_tools_rates_come_from_its_printed_summary() -> None:
    out = "noise\nStatistics summary:\nruntime_sec = 101.250\nrequests_per_sec = 0.612\n-----\n"
    assert mt.tool_rates(out) == {"runtime_sec": 101.25, "requests_per_sec": 0.612}
    with pytest.raises(ValueError, match="requests_per_sec"):
        mt.tool_rates("runtime_sec = 1.0\n")


PREFILL_BEFORE = """\
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2"} 10.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2"} 2.0
"""
PREFILL_AFTER = PREFILL_BEFORE.replace("} 10.0", "} 55.0")
SERVE_AFTER = """\
# TYPE pdclient_remote_prefill_decisions_total counter
pdclient_remote_prefill_decisions_total{reason="uncached_at_or_above_threshold",remote_prefill="true",route="chat"} 40.0
pdclient_remote_prefill_decisions_total{reason="uncached_below_threshold",remote_prefill="false",route="chat"} 22.0
"""


def test_counters_are_the_difference_of_two_scrapes_by_label() -> None:
    requests = mt.counter_delta(PREFILL_BEFORE, PREFILL_AFTER, "vllm:request_success", by=())
    assert requests == {"": 45.0}
    decisions = mt.counter_delta("", SERVE_AFTER, "pdclient_remote_prefill_decisions", by=("remote_prefill", "reason"))
    assert decisions == {
        "true uncached_at_or_above_threshold": 40.0,
        "false uncached_below_threshold": 22.0,
    }


def test_the_cost_lines_are_read_from_pdclients_scrape() -> None:
    scrape = """# TYPE pdclient_cost_fixed_ms gauge
pdclient_cost_fixed_ms{endpoint="http://d/v1",line="decode_prefill"} 30.5
pdclient_cost_fixed_ms{endpoint="",line="handoff"} 266.0
# TYPE pdclient_cost_ms_per_token gauge
pdclient_cost_ms_per_token{endpoint="http://d/v1",line="decode_prefill"} 1.25
pdclient_cost_ms_per_token{endpoint="",line="handoff"} 0.0
# TYPE pdclient_cost_samples gauge
pdclient_cost_samples{endpoint="http://d/v1",line="decode_prefill"} 12.0
pdclient_cost_samples{endpoint="",line="handoff"} 0.0
"""
    assert mt.cost_lines(scrape) == {"decode_prefill http://d/v1": [30.5, 1.25, 12.0], "handoff": [266.0, 0.0, 0.0]}
    assert mt.cost_lines(SERVE_AFTER) == {}  # a revision without them


def test_the_decode_only_share_counts_pdclients_decisions_not_to_hand_off() -> None:
    decisions = {"true uncached_at_or_above_threshold": 45.0, "false mostly_cached": 15.0}
    assert mt.decode_only_share(decisions) == 0.25
    assert mt.decode_only_share({}) is None


def test_failed_requests_are_counted_from_the_tools_log() -> None:
    out = (
        "[WARNING] - Client 0 - Request rejected during conversation ID CONV_ID_2 (turn: 1)\n"
        "[ERROR] - Client 1 - Timeout during conversation ID CONV_ID_3 (turn: 3). Base timeout is 120s\n"
        "[ERROR] - Client 1 - Exception during conversation ID CONV_ID_5 (turn: 1)\n"
        "[INFO] - Client 0 is done (num_successes=8, num_failures=1)\n"
    )
    assert mt.failed_requests(out) == 3
