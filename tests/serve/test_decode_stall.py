"""``pdclient serve --max-decode-stall-share`` and ``--max-decode-stall-ms``: a follow-up goes
decode-only only if the decode server's running streams (its ``/metrics``, scraped) would
wait no longer than the budget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.process import ServeProcess, metric_samples
from tests.stubserver import StubServer

SYSTEM = "You are a careful assistant. " + "Answer briefly and cite the manual where you can. " * 30


@pytest.fixture
def stubs() -> Iterator[tuple[StubServer, StubServer]]:
    # The stubs count every prompt as 900 ids, about what SYSTEM is.
    with StubServer(prompt_tokens=900) as prefill, StubServer(prompt_tokens=900) as decode:
        decode.background = 3  # three streams of someone else's, running on the decode server
        yield prefill, decode


def chat(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30)
    assert response.status_code == 200, response.text
    return response


def follow_up_reason(stubs: tuple[StubServer, StubServer], *flags: str) -> tuple[str, str]:
    """A conversation's first turn and follow-up through a fresh proxy: the follow-up's
    ``x-pd-remote-prefill-reason``, and the proxy's ``/metrics``."""
    prefill, decode = stubs
    proxy = ServeProcess(
        "--prefill", prefill.url, "--decode", decode.url, "--load-signals", "on", "--trace-headers", *flags
    )  # fmt: skip
    try:
        time.sleep(1.0)  # a scrape of the decode's /metrics (every 0.5 s): its three running streams
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}]
        answer = chat(proxy.url, messages).json()["choices"][0]["message"]["content"]
        follow_up = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
        reason = chat(proxy.url, follow_up).headers["x-pd-remote-prefill-reason"]
        return reason, httpx.get(f"{proxy.url}/metrics", timeout=10).text
    finally:
        proxy.stop()


def test_the_stall_budget_flag_decides_a_follow_up_while_the_decode_runs_streams(
    stubs: tuple[StubServer, StubServer],
) -> None:
    reason, metrics = follow_up_reason(stubs, "--max-decode-stall-ms", "1000")
    assert reason == "decode_only_faster"
    reason, metrics = follow_up_reason(stubs, "--max-decode-stall-ms", "0")
    assert reason == "stall_over_budget"
    labels = (("reason", "stall_over_budget"), ("remote_prefill", "true"), ("route", "chat"))
    assert metric_samples(metrics)[("pdclient_remote_prefill_decisions_total", labels)] == 1.0
    # A share of the streams' answer time (the prior's 1.5 s before any answer is learnt).
    reason, metrics = follow_up_reason(stubs, "--max-decode-stall-share", "1")
    assert reason == "decode_only_faster"
    reason, metrics = follow_up_reason(stubs, "--max-decode-stall-share", "0")
    assert reason == "stall_over_budget"
    answer = (("endpoint", stubs[1].url), ("line", "answer"))
    assert metric_samples(metrics)[("pdclient_cost_fixed_ms", answer)] == 1500.0


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-decode-stall-ms", "-5", "max_decode_stall_ms must be a finite number >= 0"),
        ("--max-decode-stall-share", "1.5", r"max_decode_stall_share must be in \[0, 1\]"),
    ],
)
def test_the_stall_budget_flags_are_checked(flag: str, value: str, message: str) -> None:
    proxy = None
    with pytest.raises(AssertionError, match=message):
        proxy = ServeProcess("--prefill", "http://127.0.0.1:9/v1", "--decode", "http://127.0.0.1:9/v1", flag, value)
    assert proxy is None
