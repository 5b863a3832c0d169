"""``pools.StallLedger``: the stalls charged to one endpoint's running streams."""

from __future__ import annotations

import pytest

from pdclient.pools import StallLedger


def test_a_stall_is_charged_to_every_stream_running_when_its_turn_was_admitted() -> None:
    ledger = StallLedger()
    ledger.charge(100.0)  # no stream runs: nobody waits
    assert (ledger.running, ledger.most_charged_ms()) == (0, 0.0)
    oldest = ledger.begin()
    ledger.charge(100.0)
    newer = ledger.begin()
    ledger.charge(50.0)
    # The oldest stream waited for both turns, the newer one for the second only.
    assert (ledger.running, ledger.most_charged_ms()) == (2, 150.0)
    ledger.end(oldest)
    assert (ledger.running, ledger.most_charged_ms()) == (1, 50.0)
    ledger.end(newer)
    assert (ledger.running, ledger.most_charged_ms()) == (0, 0.0)
    assert ledger.begin() == 150.0 and ledger.most_charged_ms() == 0.0  # a new stream starts uncharged


def test_streams_that_began_together_end_one_at_a_time() -> None:
    ledger = StallLedger()
    first, second = ledger.begin(), ledger.begin()
    assert first == second
    ledger.charge(80.0)
    ledger.end(first)
    assert (ledger.running, ledger.most_charged_ms()) == (1, 80.0)
    ledger.end(second)
    assert (ledger.running, ledger.most_charged_ms()) == (0, 0.0)


@pytest.mark.parametrize("stall_ms", [0.0, -5.0, float("inf"), float("nan")])
def test_a_stall_that_is_not_a_wait_is_not_charged(stall_ms: float) -> None:
    ledger = StallLedger()
    ledger.begin()
    ledger.charge(stall_ms)
    assert ledger.most_charged_ms() == 0.0
