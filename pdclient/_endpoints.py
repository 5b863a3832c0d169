"""Endpoint settings: where the prefill and decode legs go, resolved once at construction."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from ._errors import PDConfigError

PREFILL_ENV = "PDCLIENT_PREFILL_BASE_URL"
DECODE_ENV = "PDCLIENT_DECODE_BASE_URL"

URLArg = str | httpx.URL | Sequence[str | httpx.URL] | None


def resolve_urls(value: URLArg, *, argument: str, env: str) -> tuple[str, ...]:
    """Normalise one URL or a list of URLs, falling back to a comma-separated env var."""
    source = argument
    if value is None:
        raw = os.environ.get(env, "")
        value = [part for part in (p.strip() for p in raw.split(",")) if part]
        source = f"{argument} (from ${env})"
        if not value:
            raise PDConfigError(f"{argument} is required: pass it, or set ${env} (comma-separated URLs)")
    items = [value] if isinstance(value, str | httpx.URL) else list(value)
    if not items:
        raise PDConfigError(f"{source} is an empty list; give at least one URL")
    return tuple(_normalise(item, source) for item in items)


def _normalise(item: object, source: str) -> str:
    if not isinstance(item, str | httpx.URL):
        raise PDConfigError(f"{source}: expected a URL string, got {type(item).__name__}")
    try:
        url = httpx.URL(str(item).strip())
    except httpx.InvalidURL as exc:
        raise PDConfigError(f"{source}: invalid URL {str(item)!r}: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise PDConfigError(f"{source}: {str(item)!r} is not an http(s) URL with a host")
    return str(url).rstrip("/")


@dataclass
class EndpointPool:
    """The URLs of one leg, taken in turn."""

    urls: tuple[str, ...]
    _turn: itertools.count[int] = field(default_factory=itertools.count, repr=False, compare=False)

    def pick(self) -> str:
        # next() on itertools.count is atomic under the GIL: safe across threads and tasks.
        return self.urls[next(self._turn) % len(self.urls)]

    def base_of(self, url: str) -> str | None:
        """The pool URL that ``url`` lies under, if any."""
        for base in self.urls:
            if url == base or url.startswith(base + "/"):
                return base
        return None
