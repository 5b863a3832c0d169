"""The real-pair tier: one real local prefill+decode vLLM pair (NIXL on CPU) for the session.

Every test here is marked ``pair`` (by tests/conftest.py); ``pytest -m "not pair"`` skips
the tier. The server environment and the model are prepared at collection time (minutes
on a fresh machine, outside any per-test timeout); the pair itself starts once, in the
first test's setup, and is shared by every test of the tier.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import openai
import pytest

from pdclient.local import LocalPD, _prepare


def pytest_collection_finish(session: pytest.Session) -> None:
    # After -m/-k deselection: prepare only when a pair test will actually run.
    if any(item.get_closest_marker("pair") for item in session.items) and not os.environ.get("PDCLIENT_E2E_PAIR"):
        logging.getLogger("pdclient.local").setLevel(logging.INFO)
        _prepare.server_python()
        _prepare.model_dir()


@pytest.fixture(scope="session")
def plain(pd: LocalPD) -> Iterator[openai.OpenAI]:
    """The decode server alone, no P/D: the reference answers come from here."""
    with openai.OpenAI(base_url=pd.decode_url, api_key="EMPTY", max_retries=0) as client:
        yield client


class AttachedPair(LocalPD):
    """An already running pair (``PDCLIENT_E2E_PAIR=prefill_url,decode_url``): no start, no stop.

    For iterating on the real-pair tests without a server restart per run, or for running
    them against another deployment serving the same model.
    """

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        super().__init__()
        self._urls = (prefill_url.strip().rstrip("/"), decode_url.strip().rstrip("/"))

    @property
    def prefill_url(self) -> str:
        return self._urls[0]

    @property
    def decode_url(self) -> str:
        return self._urls[1]


@pytest.fixture(scope="session")
def pd() -> Iterator[LocalPD]:
    """The real pair, started once per session (~7 GB, ~30 s) by its first user."""
    attach = os.environ.get("PDCLIENT_E2E_PAIR")
    if attach:
        prefill_url, decode_url = attach.split(",")
        yield AttachedPair(prefill_url, decode_url)
        return
    # Tool calling on, so the framework and example tests can share this one pair.
    with LocalPD(extra_server_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as pair:
        yield pair
