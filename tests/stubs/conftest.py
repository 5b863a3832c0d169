"""What the loopback-stub tests share: a prefill stub answering in vLLM's push mode."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.stubserver import StubServer


def push_params(request_id: str, n_ids: int) -> dict[str, Any]:
    """A push-mode prefill server's ``kv_transfer_params``: its coordinates, which concurrent dispatch sends ahead."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1000],
        "remote_engine_id": "stub-prefill-engine-0",
        "remote_request_id": request_id,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_mode": "push",
    }


@contextmanager
def push_stubs() -> Iterator[tuple[StubServer, StubServer]]:
    """A prefill stub in push mode and a decode stub, 64 prompt tokens each."""
    with StubServer(prompt_tokens=64) as prefill, StubServer(prompt_tokens=64) as decode:
        prefill._kv_params = push_params  # type: ignore[method-assign]
        yield prefill, decode


@pytest.fixture
def push_pair() -> Iterator[tuple[StubServer, StubServer]]:
    """``push_stubs``, fresh for each test (its fault hooks and counts its own)."""
    with push_stubs() as pair:
        yield pair
