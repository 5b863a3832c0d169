"""Fixtures shared by the tiers, and the tiers themselves: one directory each.

    tests/unit/          pure functions, no I/O
    tests/mocked/        the clients and transports against the fake vLLM through respx (in process)
    tests/stubs/         the same against the fake vLLM on real loopback sockets: faults, soak
    tests/serve/         `pdclient serve` against the stub, real clients (Node's openai, curl), processes
    tests/pair/          a real prefill+decode vLLM pair (started once per session): marked ``pair``
    tests/server_patch/  the vLLM plugin, inside the vLLM environment (tests/server_patch/run.py)

The directory is the tier: tests under tests/pair are marked ``pair`` here, so
``pytest -m "not pair"`` runs everything that needs no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_vllm import DECODE, PREFILL, FakeVLLM

PAIR_TIER = Path(__file__).parent / "pair"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PAIR_TIER in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.pair)
            # Bound the test bodies, not the server starts: those have their own deadlines
            # (LocalPD's startup_timeout) and take minutes when the 2 cores are contended.
            item.add_marker(pytest.mark.timeout(300, func_only=True))


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    """Run a test once with PDChatClient and once with AsyncPDChatClient."""
    return str(request.param)


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    """The fake vLLM pair at PREFILL / DECODE through respx; ``fake.router`` has its named routes."""
    vllm = FakeVLLM()
    with vllm.routes(PREFILL, DECODE):
        yield vllm


@pytest.fixture
def pd_routes(fake: FakeVLLM) -> Any:
    """The respx router of ``fake``: routes ``prefill``, ``decode`` and ``models``."""
    return fake.router
