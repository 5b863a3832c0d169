"""Where each endpoint publishes its KV events: the ``kv_events`` setting, checked at start.

- ``"discover"``: ask each server (``GET /kv_event_sources`` at its root, vLLM's answer of
  its publisher's config per data-parallel rank); rank 0's addresses, with the endpoint's
  own host in place of the wildcard vLLM binds.
- a template on the endpoint's host: ``"tcp://{host}:5557"``, or with the replay socket
  after a comma, ``"tcp://{host}:5557,tcp://{host}:5558"`` (without one, a view that
  missed messages stays unknown until the server's cache is cleared or it restarts).
- a port: ``5557``, the same as ``"tcp://{host}:5557"``.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from .._errors import PDConfigError
from ._subscriber import KVEventSource

DISCOVER = "discover"
DISCOVERY_PATH = "/kv_event_sources"
_SCHEMES = ("tcp://", "ipc://")


def check_setting(value: object, name: str = "kv_events") -> str | None:
    """The setting as a template (or ``"discover"``), None when off; a ``PDConfigError``
    naming what is wrong otherwise."""
    if value is None or value is False:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 < value < 65536:
            raise PDConfigError(f"{name} port must be in 1..65535, got {value}")
        return "tcp://{host}:" + str(value)
    if not isinstance(value, str):
        raise PDConfigError(
            f"{name} must be 'discover', a port, or an address template like 'tcp://{{host}}:5557', got {value!r}"
        )
    if value == DISCOVER:
        return value
    for address in value.split(","):
        if not address.startswith(_SCHEMES):
            raise PDConfigError(f"{name}: {address!r} is not a tcp:// or ipc:// address (in {value!r})")
        try:
            address.format(host="h")
        except (KeyError, IndexError, ValueError) as exc:
            raise PDConfigError(f"{name}: {address!r} may name only {{host}} ({exc})") from exc
    if value.count(",") > 1:
        raise PDConfigError(f"{name} takes a publisher and at most one replay address, got {value!r}")
    return value


def source_for(template: str, endpoint: str) -> KVEventSource:
    """The endpoint's source from a template (not ``"discover"``)."""
    host = _host(endpoint)
    publisher, _, replay = template.partition(",")
    return KVEventSource(endpoint, publisher.format(host=host), replay.format(host=host) or None, "")


def source_from_discovery(endpoint: str, answer: str) -> KVEventSource | None:
    """The endpoint's source from its ``GET /kv_event_sources`` body; None when it publishes
    none (an empty answer: events off). ``ValueError`` on an answer of another shape."""
    sources = json.loads(answer)
    if not isinstance(sources, dict):
        raise ValueError(f"kv_event_sources answered {type(sources).__name__}, not an object")
    if not sources:
        return None
    config = sources.get("0", next(iter(sources.values())))
    if not isinstance(config, dict) or not isinstance(config.get("endpoint"), str):
        raise ValueError(f"kv_event_sources has no publisher endpoint: {answer[:200]!r}")
    if config.get("enable_kv_cache_events") is False or config.get("publisher") not in (None, "zmq"):
        return None
    host = _host(endpoint)
    replay = config.get("replay_endpoint")
    topic = config.get("topic")
    return KVEventSource(
        endpoint,
        _on_host(config["endpoint"], host),
        _on_host(replay, host) if isinstance(replay, str) and replay else None,
        topic if isinstance(topic, str) else "",
    )


def _host(endpoint: str) -> str:
    host = urlsplit(endpoint).hostname
    if not host:
        raise PDConfigError(f"kv_events: endpoint {endpoint!r} has no host")
    return f"[{host}]" if ":" in host else host


def _on_host(address: str, host: str) -> str:
    """A bound address (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) as one to connect to."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if address.startswith(prefix):
            return f"tcp://{host}:" + address[len(prefix) :]
    return address
