"""``pools.BusyShare``: the moving share of time an endpoint has this process's requests in flight."""

from __future__ import annotations

import math

import pytest

from pdclient.pools import BreakerSettings, BusyShare, Endpoint
from tests.clock import Clock


def test_an_endpoint_never_busy_has_a_share_of_zero() -> None:
    assert BusyShare(clock=Clock()).share() == 0.0


def test_the_share_rises_while_busy_and_decays_while_idle() -> None:
    clock = Clock()
    share = BusyShare(tau=30.0, clock=clock)
    share.set(True)
    clock.now = 30.0
    assert share.share() == pytest.approx(1 - math.exp(-1))
    share.set(False)
    clock.now = 60.0
    assert share.share() == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    assert share.share(90.0) < share.share(60.0)  # read at a later time without a change


def test_an_endpoint_is_busy_from_its_first_request_to_its_last() -> None:
    clock = Clock()
    endpoint = Endpoint("http://p/v1", BreakerSettings(), clock)
    endpoint.acquire()
    endpoint.acquire()
    clock.now = 10.0
    endpoint.release(ok=True)  # one still in flight: still busy
    clock.now = 20.0
    endpoint.release(ok=True)
    clock.now = 40.0
    assert endpoint.busy.share() == pytest.approx((1 - math.exp(-20 / 30)) * math.exp(-20 / 30))
