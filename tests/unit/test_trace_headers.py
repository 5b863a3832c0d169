"""``PDTrace.to_headers``: each header field as pydantic would dump it for JSON, one header each."""

from __future__ import annotations

from pdclient import Outcome, PDTrace


def _every_field() -> PDTrace:
    return PDTrace(
        request_id="r-1",
        leg_request_id="leg-1",
        route="chat",
        outcome=Outcome.PREFILL_FAILED,
        prefill_url="http://p:1/v1",
        decode_url="http://d:2/v1",
        prefill_ms=1.23456,
        prefill_attempts=2,
        decode_headers_ms=0.5,
        decode_first_byte_ms=0.75,
        forwarded_tokens=17,
        ids_skipped="too long",
        handoff_cpu_ms=0.0125,
        fallback="prefill failed: line\nbreak é",
        error="boom",
        failed_leg="prefill",
        prefill_route="round_robin",
        decode_route="least_loaded",
        remote_prefill=False,
        remote_prefill_reason="threshold",
        conversation="hit",
        estimated_prompt_tokens=100,
        estimated_uncached_tokens=10,
        prefill_warm_up_url="http://w:3/v1",
        dispatch="concurrent",
        dispatch_fallback="decode_failed",
    )


def test_headers_hold_each_shown_field_as_its_json_value_in_field_order() -> None:
    assert list(_every_field().to_headers().items()) == [
        ("x-pd-request-id", "r-1"),
        ("x-pd-route", "chat"),
        ("x-pd-outcome", "prefill_failed"),
        ("x-pd-prefill-url", "http://p:1/v1"),
        ("x-pd-decode-url", "http://d:2/v1"),
        ("x-pd-prefill-ms", "1.235"),
        ("x-pd-prefill-attempts", "2"),
        ("x-pd-decode-headers-ms", "0.500"),
        ("x-pd-forwarded-tokens", "17"),
        ("x-pd-ids-skipped", "too long"),
        ("x-pd-handoff-cpu-ms", "0.013"),
        ("x-pd-fallback", "prefill failed: line break \\xe9"),
        ("x-pd-error", "boom"),
        ("x-pd-failed-leg", "prefill"),
        ("x-pd-prefill-route", "round_robin"),
        ("x-pd-decode-route", "least_loaded"),
        ("x-pd-remote-prefill", "false"),
        ("x-pd-remote-prefill-reason", "threshold"),
        ("x-pd-conversation", "hit"),
        ("x-pd-estimated-prompt-tokens", "100"),
        ("x-pd-estimated-uncached-tokens", "10"),
        ("x-pd-prefill-warm-up-url", "http://w:3/v1"),
        ("x-pd-dispatch", "concurrent"),
        ("x-pd-dispatch-fallback", "decode_failed"),
    ]


def test_headers_leave_out_what_is_none_and_what_is_known_only_later() -> None:
    headers = PDTrace(request_id="r", route="chat", decode_first_byte_ms=1.0, leg_request_id="l").to_headers()
    assert headers == {
        "x-pd-request-id": "r",
        "x-pd-route": "chat",
        "x-pd-outcome": "disaggregated",
        "x-pd-prefill-attempts": "0",
        "x-pd-forwarded-tokens": "0",
    }
    assert PDTrace.from_headers(headers) == PDTrace(request_id="r", route="chat")


def test_header_values_are_single_spaced_ascii_lines() -> None:
    for given, expected in [
        ("plain", "plain"),
        (" padded  twice ", "padded twice"),
        ("tab\there", "tab here"),
        ("line\r\nbreak", "line break"),
        ("caf\u00e9\u2028x", "caf\\xe9 x"),
        ("\x00nul", "\x00nul"),
    ]:
        headers = PDTrace(request_id=given, route="chat").to_headers()
        assert headers["x-pd-request-id"] == expected, given
