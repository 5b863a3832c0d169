"""Request ids: unique within a process and across forked children, without a kernel call per id."""

from __future__ import annotations

import os

from pdclient.handoff import new_request_id


def test_ids_are_unique_and_share_this_processs_prefix() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert len({i.rsplit("-", 1)[0] for i in ids}) == 1 and ids[0].startswith("pd-")


def test_a_forked_child_draws_its_own_prefix() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    mine = new_request_id()
    assert child.rsplit("-", 1)[0] != mine.rsplit("-", 1)[0]
