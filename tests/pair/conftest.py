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

from pdclient.local import PDServers, _prepare, pair_from_env_or_local
from pdclient.pools import DECODE_ENV, PREFILL_ENV


def pytest_collection_finish(session: pytest.Session) -> None:
    # After -m/-k deselection: prepare only when a pair test will actually run.
    if any(item.get_closest_marker("pair") for item in session.items) and not os.environ.get("PDCLIENT_E2E_PAIR"):
        logging.getLogger("pdclient.local").setLevel(logging.INFO)
        _prepare.server_python()
        _prepare.model_dir()


@pytest.fixture(scope="session")
def plain(pd: PDServers) -> Iterator[openai.OpenAI]:
    """The decode server alone, no P/D: the reference answers come from here."""
    with openai.OpenAI(base_url=pd.decode_url, api_key="EMPTY", max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def pd() -> Iterator[PDServers]:
    """The real servers, started once per session (~7 GB, ~30 s) by their first user.

    ``PDCLIENT_E2E_PAIR=prefill_url,decode_url`` attaches to a running pair instead (no
    start, no stop; ``pd.local`` is None): for iterating on the real-pair tests without a
    server restart per run, or for running them against another deployment serving the
    same model. A variable of its own, not ``PDCLIENT_PREFILL_BASE_URL`` /
    ``PDCLIENT_DECODE_BASE_URL``: those configure pdclient's clients, and the client
    tests set and clear them; exported in a shell for other work, they must not
    silently move the real-pair tier to other servers.
    """
    environ: dict[str, str] = {}
    attach = os.environ.get("PDCLIENT_E2E_PAIR")
    if attach:
        prefill_url, decode_url = attach.split(",")
        environ = {PREFILL_ENV: prefill_url, DECODE_ENV: decode_url}
    # Tool calling on, so the framework and example tests can share this one pair; the
    # Responses store on, for previous_response_id follow-ups (nothing else reads it).
    with pair_from_env_or_local(
        environ=environ,
        extra_server_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        responses_store=True,
    ) as servers:
        yield servers
