"""LocalPD's port choice and core assignment, without vLLM."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from pdclient import PDConfigError, PDSetupError
from pdclient.local import LocalPD
from pdclient.local._pair import assign_cpus
from pdclient.local._ports import PortClaim, candidate_ranges, claim_ports, ephemeral_range, is_free


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)  # Linux's default


def test_candidates_lie_outside_the_ephemeral_range() -> None:
    assert candidate_ranges((32768, 60999)) == [range(10000, 32768), range(61000, 65536)]
    assert candidate_ranges((1024, 65535)) == []
    assert candidate_ranges((10000, 20000)) == [range(20001, 65536)]
    assert candidate_ranges((50000, 65535)) == [range(10000, 50000)]


def test_claimed_ports_are_outside_the_machines_ephemeral_range_distinct_and_free() -> None:
    first, last = ephemeral_range()
    claims = claim_ports(12)
    try:
        ports = [c.port for c in claims]
        assert len(set(ports)) == 12
        assert not any(first <= p <= last for p in ports)
        assert all(is_free(p) for p in ports)
    finally:
        for c in claims:
            c.release()


def test_a_claimed_port_is_not_handed_out_again_until_released() -> None:
    only = [range(23456, 23460)]  # four candidates
    held = claim_ports(2, ranges=only)
    try:
        more = claim_ports(2, ranges=only)
        assert {c.port for c in more}.isdisjoint({c.port for c in held})
        with pytest.raises(PDSetupError, match="found only 0 of 1 free loopback ports"):
            claim_ports(1, ranges=only)
        for c in more:
            c.release()
        assert PortClaim.take(more[0].port) is not None  # released: claimable again
    finally:
        for c in held:
            c.release()


def test_a_claim_is_seen_by_another_socket_as_another_process_would() -> None:
    (claim,) = claim_ports(1)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other, pytest.raises(OSError):
            other.bind(f"\0pdclient-port-{claim.port}")
    finally:
        claim.release()


def test_bound_and_avoided_ports_are_skipped() -> None:
    with socket.create_server(("127.0.0.1", 23470)):
        assert not is_free(23470)
        claims = claim_ports(2, ranges=[range(23470, 23474)], avoid={23471}, rng=random.Random(0))
    try:
        assert {c.port for c in claims} == {23472, 23473}
    finally:
        for c in claims:
            c.release()


def test_the_search_starts_at_a_random_place() -> None:
    starts = set()
    for seed in range(20):
        (claim,) = claim_ports(1, rng=random.Random(seed))
        claim.release()
        starts.add(claim.port)
    assert len(starts) > 15


def test_a_pair_plans_distinct_ports_and_keeps_explicit_ones() -> None:
    with socket.create_server(("127.0.0.1", 0)) as explicit:
        port = explicit.getsockname()[1]
    pd = LocalPD(prefill_servers=2, decode_servers=2, decode_port=port)
    plan = pd._plan_ports()
    try:
        assert plan[2][0] == port  # the first decode server's API port, as given
        used = [p for pair in plan for p in pair if p is not None]
        assert len(used) == 8 and len(set(used)) == 8
        first, last = ephemeral_range()
        assert not any(first <= p <= last for p in used if p != port)
    finally:
        pd.stop()


def test_no_side_channel_ports_without_nixl() -> None:
    pd = LocalPD(kv_connector=None)
    try:
        assert [side for _, side in pd._plan_ports()] == [None, None]
    finally:
        pd.stop()


@pytest.mark.parametrize(
    ("prefill", "decode", "cores", "expected"),
    [
        (1, 1, [0, 1], (0, 1)),
        (1, 2, [0, 1], (0, 1, 1)),
        (2, 1, [0, 1], (0, 0, 1)),
        (2, 2, [0, 1], (0, 0, 1, 1)),
        (1, 2, [0, 1, 2, 3], (0, 1, 2)),
        (1, 1, [3], (3, 3)),
        (3, 1, [0, 1, 2], (0, 1, 0, 2)),
        (1, 1, [5, 2], (2, 5)),
    ],
)
def test_core_assignment(prefill: int, decode: int, cores: list[int], expected: tuple[int, ...]) -> None:
    assert assign_cpus(prefill, decode, cores) == expected


def test_cpus_need_one_entry_per_server() -> None:
    assert LocalPD(decode_servers=2, cpus=(0, 1, None)).cpus == (0, 1, None)
    assert LocalPD(cpus=None).cpus == (None, None)
    with pytest.raises(PDConfigError, match=r"2 entries for 3 servers"):
        LocalPD(decode_servers=2, cpus=(0, 1))
    with pytest.raises(PDConfigError, match="at least one server of each role"):
        LocalPD(prefill_servers=0)


def test_kv_events_get_two_ports_a_server_distinct_from_the_others() -> None:
    pd = LocalPD(kv_events=True)
    try:
        plan = pd._plan_ports()
        used = [p for pair in plan for p in pair if p is not None]
        events = [p for pair in pd._kv_event_ports for p in pair]
        assert len(events) == 4 and len(set(used + events)) == len(used) + 4
    finally:
        pd.stop()
