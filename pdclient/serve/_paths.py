"""The paths a caller may reach: only under ``/v1``, read as the servers' router reads them;
and a server's ``Location`` as the proxy's own path."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import quote_from_bytes, unquote_to_bytes, urlsplit

API_PREFIX = "/v1"
_API_PREFIX_BYTES = API_PREFIX.encode("ascii") + b"/"
# What a path keeps unescaped when it is encoded again: RFC 3986's pchar and "/".
_PATH_SAFE = "/:@!$&'()*+,;="


def upstream_path(raw_path: bytes) -> str | None:
    """The path to send the servers for a caller's ``raw_path`` (as it came, encoded), or
    None when it does not stay under ``/v1/``.

    The servers' router (vLLM's, Starlette's) sees a path percent-decoded once, so the
    proxy reads it so too: ``/v1/chat%2Fcompletions`` is the chat route, for the handoff as
    for the server. Then ``.`` and ``..`` segments are resolved (HTTP clients resolve them
    before sending; they must not lead out of ``/v1``) and repeated slashes merged, and the
    result is encoded again: the servers get one spelling, the very path the handoff chose
    its route by. A ``%2F`` in a segment so becomes a ``/`` (to vLLM's router they are one).
    """
    decoded = unquote_to_bytes(raw_path)
    segments: list[bytes] = []
    for segment in decoded.split(b"/"):
        if segment == b"..":
            if segments:
                segments.pop()
        elif segment not in (b"", b"."):
            segments.append(segment)
    path = b"/" + b"/".join(segments)
    if decoded.endswith((b"/", b"/.", b"/..")) and segments:
        path += b"/"
    if not path.startswith(_API_PREFIX_BYTES):
        return None
    return quote_from_bytes(path, safe=_PATH_SAFE)


def base_paths(urls: Iterable[str]) -> tuple[bytes, ...]:
    """The paths the servers' base URLs lie at (``/v1`` for vLLM's), longest first."""
    paths = {urlsplit(url).path.rstrip("/").encode("utf-8") for url in urls}
    return tuple(sorted(paths, key=len, reverse=True))


def own_location(location: bytes, bases: tuple[bytes, ...]) -> bytes | None:
    """A server's ``Location`` as the proxy's own path, or None to drop it.

    A server builds it from the Host it was sent (vLLM's redirect of a trailing slash:
    ``http://<decode host:port>/v1/models``), so passed on it would name the server. A path
    under a server's base (``bases``) becomes the same path under the proxy's ``/v1``,
    relative (no scheme, no host); a reference relative to the request's own path names
    nothing and passes as it is; any other (another host's path, one outside the bases)
    is dropped.
    """
    split = urlsplit(location)
    if not split.scheme and not split.netloc and not location.startswith(b"/"):
        return location
    for base in bases:
        if split.path == base or split.path.startswith(base + b"/"):
            own = API_PREFIX.encode("ascii") + split.path[len(base) :]
            return own + b"?" + split.query if split.query else own
    return None
