"""Request ids: the legs' id is 128 random bits per call, in forked children too; a
correlation id made for a caller that gave none is random too, and another id."""

from __future__ import annotations

import os
import re

from pdclient.handoff import new_correlation_id, new_leg_id


def test_leg_ids_are_random_per_call_with_no_shared_prefix() -> None:
    ids = [new_leg_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"pd-[0-9a-f]{32}", i) for i in ids)
    assert len({i[:11] for i in ids}) > 9_000, "32 random bits up front: a shared prefix would show"


def test_a_correlation_id_is_not_a_leg_id() -> None:
    assert re.fullmatch(r"req-[0-9a-f]{32}", new_correlation_id())


def test_a_forked_child_draws_ids_of_its_own() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out
        os.write(write, new_leg_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child != new_leg_id() and child.startswith("pd-")
