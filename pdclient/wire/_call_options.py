"""The per-call options (``extra_body={"pdclient": {...}}``): their names, types and checks, read
from the caller's body by the wire layer; ``PDOptions`` validates its fields with the same checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from .._errors import PDConfigError

REMOTE_PREFILL_MODES: tuple[str, ...] = ("always", "never", "auto")
DISPATCH_MODES: tuple[str, ...] = ("sequential", "concurrent", "auto")


# The userinfo of every URL in a text: from "://" to the last "@" before the host's end.
_USERINFO = re.compile(r"(?<=://)[^/?#\s]*@")


REDACTED = "***@"


def redact_url(text: str) -> str:
    """A URL, or a text holding URLs, with each URL's credentials (``user:password@``)
    replaced by ``***@``: what may be shown (logs, traces, errors, ``/ready``, metrics)."""
    return _USERINFO.sub(REDACTED, text) if "@" in text else text


def normalise_url(item: object, source: str) -> str:
    if not isinstance(item, str | httpx.URL):
        raise PDConfigError(f"{source}: expected a URL string, got {type(item).__name__}")
    try:
        url = httpx.URL(str(item).strip())
    except httpx.InvalidURL as exc:
        raise PDConfigError(f"{source}: invalid URL {redact_url(str(item))!r}: {redact_url(str(exc))}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise PDConfigError(f"{source}: {redact_url(str(item))!r} is not an http(s) URL with a host")
    return str(url).rstrip("/")


PREFILL_FAILURE_POLICIES = ("decode", "fail")
"""Besides these, ``on_prefill_failure`` may be the base URL of a fallback server."""


CALL_OPTIONS_KEY = "pdclient"


def check_failure_policy(value: object, source: str) -> str:
    if value in PREFILL_FAILURE_POLICIES:
        return str(value)
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return normalise_url(value, source)
    raise PDConfigError(f"{source} must be one of {PREFILL_FAILURE_POLICIES} or a fallback base URL, got {value!r}")


def check_migrations(value: object, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PDConfigError(f"{source} must be an int >= 0 (0 turns decode migration off), got {value!r}")
    return value


def check_remote_prefill(value: object, source: str) -> str:
    if value in REMOTE_PREFILL_MODES:
        return str(value)
    raise PDConfigError(f"{source} must be one of {', '.join(REMOTE_PREFILL_MODES)}, got {value!r}")


def check_dispatch(value: object, source: str) -> str:
    if value in DISPATCH_MODES:
        return str(value)
    raise PDConfigError(f"{source} must be one of {', '.join(DISPATCH_MODES)}, got {value!r}")


@dataclass(frozen=True)
class CallOptions:
    """Per-call options from ``extra_body={"pdclient": {...}}``; None means "the client's"."""

    on_prefill_failure: str | None = None
    session: str | None = None
    """An explicit affinity key (a user or conversation id) instead of the conversation's opening."""
    forward_ids: bool = True
    """False sends the decode leg no ids (it renders and tokenizes the prompt itself): for A/B checks."""
    max_decode_migrations: int | None = None
    """This call's bound on decode migrations (``PDOptions.max_decode_migrations``)."""
    remote_prefill: str | None = None
    """``always``, ``never`` or ``auto`` for this call (``PDOptions.remote_prefill``)."""
    dispatch: str | None = None
    """``sequential``, ``concurrent`` or ``auto`` for this call (``PDOptions.dispatch``)."""


_CALL_OPTION_TYPES: Mapping[str, tuple[type, ...]] = {
    "on_prefill_failure": (str,),
    "session": (str, int),
    "forward_ids": (bool,),
    "max_decode_migrations": (int,),
    "remote_prefill": (str,),
    "dispatch": (str,),
}


def parse_call_options(value: object) -> CallOptions:
    """The per-call options object, checked; ``PDConfigError`` names what is wrong."""
    if value is None:
        return CallOptions()
    if not isinstance(value, dict):
        raise PDConfigError(f"{CALL_OPTIONS_KEY} must be an object of per-call options, got {type(value).__name__}")
    for name, item in value.items():
        types = _CALL_OPTION_TYPES.get(name)
        if types is None:
            raise PDConfigError(
                f"{CALL_OPTIONS_KEY}.{name} is not a per-call option; known: {', '.join(sorted(_CALL_OPTION_TYPES))}"
            )
        if not isinstance(item, types) or (bool not in types and isinstance(item, bool)):
            names = " or ".join(t.__name__ for t in types)
            raise PDConfigError(f"{CALL_OPTIONS_KEY}.{name} must be a {names}, got {item!r}")
    options = dict(value)
    if "on_prefill_failure" in options:
        options["on_prefill_failure"] = check_failure_policy(
            options["on_prefill_failure"], f"{CALL_OPTIONS_KEY}.on_prefill_failure"
        )
    if "session" in options:
        options["session"] = str(options["session"])
    if "max_decode_migrations" in options:
        check_migrations(options["max_decode_migrations"], f"{CALL_OPTIONS_KEY}.max_decode_migrations")
    if "remote_prefill" in options:
        check_remote_prefill(options["remote_prefill"], f"{CALL_OPTIONS_KEY}.remote_prefill")
    if "dispatch" in options:
        check_dispatch(options["dispatch"], f"{CALL_OPTIONS_KEY}.dispatch")
    return CallOptions(**options)
