"""register(): idempotent, never raises, skips cleanly, honours VLLM_PLUGINS."""

from __future__ import annotations

from typing import Any

import pytest


def test_register_is_idempotent(plugin: Any, chat: Any) -> None:
    cls = type(chat)
    before = (cls.preprocess_chat, getattr(cls, "_make_request_with_harmony", None))
    plugin.register()
    plugin.register()
    assert (cls.preprocess_chat, getattr(cls, "_make_request_with_harmony", None)) == before
    # Patching twice (e.g. STATE lost on a module reload) still wraps once per layer.
    if "reuse" in getattr(cls.preprocess_chat, "__pdclient_layers__", ()):
        plugin._patch(cls, "preprocess_chat", lambda f: pytest.fail("wrapped twice"))


def test_what_was_applied_matches_the_version(plugin: Any, vllm_version: str) -> None:
    reuse = plugin.STATE.applied["reuse"]
    if plugin._version_tuple(vllm_version) >= (0, 27):
        assert reuse.startswith("native"), reuse
    else:
        assert reuse.startswith("patched"), reuse
    assert plugin.STATE.applied["guard"].startswith("off")  # no secret in this process


def test_register_never_raises(plugin: Any, monkeypatch: pytest.MonkeyPatch, plugin_log: Any) -> None:
    monkeypatch.setattr(plugin, "STATE", plugin.State())

    def boom() -> None:
        raise RuntimeError("seam exploded")

    monkeypatch.setattr(plugin, "_register", boom)
    plugin.register()
    assert "not applied" in plugin_log.text


def test_missing_seam_is_skipped_and_said(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "STATE", plugin.State())
    monkeypatch.setattr(plugin, "CHAT_SEAMS", (("vllm.no_such_module", "Nope"),))
    plugin.register()
    assert plugin.STATE.applied["reuse"].startswith("skipped")


def test_bad_verify_rate_is_ignored(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("abc", "1.5", "-0.1"):
        monkeypatch.setenv(plugin.VERIFY_RATE_ENV, raw)
        assert plugin._verify_rate() == 0.0
    monkeypatch.setenv(plugin.VERIFY_RATE_ENV, "0.25")
    assert plugin._verify_rate() == 0.25


def test_max_age_setting(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin._max_age() == 300.0  # unset: the spec's default
    for raw in ("soon", "-5", "0", "nan", "inf", "40000000"):
        monkeypatch.setenv(plugin.MAX_AGE_ENV, raw)
        assert plugin._max_age() == 300.0, raw
    monkeypatch.setenv(plugin.MAX_AGE_ENV, "30")
    assert plugin._max_age() == 30.0


@pytest.mark.parametrize(("allow", "loaded"), [(None, True), ("pdclient_reuse", True), ("some_other_plugin", False)])
def test_vllm_finds_it_through_the_entry_point(
    plugin: Any, allow: str | None, loaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own plugin loader finds `pdclient_reuse` and respects the VLLM_PLUGINS allowlist."""
    from vllm.plugins import load_plugins_by_group

    if allow is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allow)
    found = load_plugins_by_group("vllm.general_plugins")
    assert ("pdclient_reuse" in found) is loaded
    if loaded:
        assert found["pdclient_reuse"].__module__ == "pdclient_server_patch"
