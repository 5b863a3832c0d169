"""End-to-end tier: one real local prefill+decode vLLM pair (NIXL on CPU) for the session.

Every test here is marked ``e2e``; ``pytest -m "not e2e"`` skips the tier. The server
environment and the model are prepared at collection time (minutes on a fresh machine,
outside any per-test timeout); the pair itself starts once, in the first test's setup.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdclient.local import PDServers, _prepare

HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end against a real local prefill+decode vLLM pair")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
            # Bound the test bodies, not the server starts: those have their own deadlines
            # (LocalPD's startup_timeout) and take minutes when the 2 cores are contended.
            item.add_marker(pytest.mark.timeout(300, func_only=True))


def pytest_collection_finish(session: pytest.Session) -> None:
    # After -m/-k deselection: prepare only when an e2e test will actually run.
    if any(item.get_closest_marker("e2e") for item in session.items) and not os.environ.get("PDCLIENT_E2E_PAIR"):
        logging.getLogger("pdclient.local").setLevel(logging.INFO)
        _prepare.server_python()
        _prepare.model_dir()


@pytest.fixture(scope="session")
def plain(pd: PDServers) -> Iterator[openai.OpenAI]:
    """The decode server alone, no P/D: the reference answers come from here."""
    with openai.OpenAI(base_url=pd.decode_url, api_key="EMPTY", max_retries=0) as client:
        yield client
