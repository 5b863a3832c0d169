"""The real-pair tier: one real local prefill+decode vLLM pair (NIXL on CPU) for the session.

Every test here is marked ``pair`` (by tests/conftest.py); ``pytest -m "not pair"`` skips
the tier. The server environment and the model are prepared at collection time (minutes
on a fresh machine, outside any per-test timeout); the pair itself starts once, in the
first test's setup, and is shared by every test of the tier.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import openai
import pytest

from pdclient.local import PDServers, _prepare, pair_from_env_or_local
from pdclient.pools import DECODE_ENV, PREFILL_ENV

from .helpers import LONG_STORY, WITH_LOGPROBS, user


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


KILLED_ANSWER_SECONDS = 35.0
"""How long an answer a test kills its decode in the middle of lasts: a caller that one of the
VM's stalls (30 s and more, ../shared/FIELD_NOTES.md) held behind still reads its 16th token
before that decode has finished."""


@pytest.fixture(scope="session")
def killed_answer_tokens(pd: PDServers) -> int:
    """The length of an answer lasting ``KILLED_ANSWER_SECONDS`` on this CPU's decode, from its
    pace on a short answer of the same kind (greedy, with top logprobs): 300 to 1,000 tokens
    (~1,000 on an AVX-512 EPYC; about half on an AVX2 one, where 1,000 took over a minute)."""
    seen: list[float] = []
    with pd.client(max_retries=0) as client:
        stream = client.chat.completions.create(
            model=pd.model,
            stream=True,
            messages=user(LONG_STORY),
            temperature=0,
            max_tokens=64,
            extra_body={"ignore_eos": True},
            **WITH_LOGPROBS,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content is not None:
                seen.append(time.monotonic())
    rate = (len(seen) - 1) / (seen[-1] - seen[0]) if len(seen) > 1 and seen[-1] > seen[0] else 28.0
    tokens = min(1000, max(300, round(rate * KILLED_ANSWER_SECONDS)))
    print(f"\nan answer to kill mid-way: {tokens} tokens ({rate:.1f} tokens/s on this decode)")
    return tokens
