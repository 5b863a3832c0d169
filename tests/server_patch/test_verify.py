"""Drift check in-process: a planted mismatch is counted, a match is not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _aio import arun
from pdclient_server_patch import _verify
from test_reuse import HELLO, OTHER, chat_request


def sample(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


def test_drift_check_counts_a_planted_mismatch(chat: Any, monkeypatch: pytest.MonkeyPatch, plugin_log: Any) -> None:
    cls = type(chat)
    monkeypatch.setattr(cls, "preprocess_chat", _verify.wrap_preprocess_chat(cls.preprocess_chat, 1.0))
    _verify.metrics()

    async def run(request: Any) -> Any:
        token = _verify.REQUEST_ID.set("req-drift")
        try:
            result = await chat.render_chat(request)
        finally:
            _verify.REQUEST_ID.reset(token)
        await asyncio.gather(*_verify._tasks)  # the background check
        return result

    _, (own,) = arun(run(chat_request(HELLO)))  # no ids forwarded: nothing checked
    hello_ids = list(own["prompt_token_ids"])
    checked, mismatched = sample("pdclient_reuse_verify_checked_total"), sample("pdclient_reuse_verify_mismatch_total")

    arun(run(chat_request(HELLO, hello_ids)))  # matching ids
    assert sample("pdclient_reuse_verify_checked_total") == checked + 1
    assert sample("pdclient_reuse_verify_mismatch_total") == mismatched

    _, (other,) = arun(run(chat_request(OTHER)))
    _, (used,) = arun(run(chat_request(HELLO, list(other["prompt_token_ids"]))))  # planted
    assert used["prompt_token_ids"] == other["prompt_token_ids"]  # the request itself is unaffected
    assert sample("pdclient_reuse_verify_checked_total") == checked + 2
    assert sample("pdclient_reuse_verify_mismatch_total") == mismatched + 1
    assert "request req-drift: forwarded prompt_token_ids differ" in plugin_log.text
