"""Where each prefill server's NIXL agent is, as its answers say: what a concurrent decode
is registered with (``handoff._dispatch``). One ``CoordinateBook`` per fleet
(``Fleet.coordinates``), shared by every copy of a client that shares the fleet."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import msgspec
import orjson


class _CoordinateFields(msgspec.Struct):
    """The fields of ``kv_transfer_params`` the coordinates come from; the others (the
    prefill's block ids: thousands, for a long prompt) are skipped unparsed."""

    remote_engine_id: object = None
    remote_host: object = None
    remote_port: object = None
    tp_size: object = None
    pp_size: object = 1
    transfer_mode: object = None


_read_coordinates = msgspec.json.Decoder(_CoordinateFields).decode


@dataclass(frozen=True)
class Coordinates:
    """Where a prefill server's NIXL agent is, as its answers' ``kv_transfer_params`` say."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    transfer_mode: str | None
    """``"push"`` or ``"pull"`` as the server reported it; None when it did not."""

    @classmethod
    def from_kv_params(cls, raw: bytes | None) -> Coordinates | None:
        """The coordinates in a prefill answer's ``kv_transfer_params``; None when any is missing or odd."""
        if not raw:
            return None
        try:
            params = _read_coordinates(raw)
        except msgspec.DecodeError:
            return None
        engine, host, port, tp = params.remote_engine_id, params.remote_host, params.remote_port, params.tp_size
        pp, mode = params.pp_size, params.transfer_mode
        if not isinstance(engine, str) or not engine or not isinstance(host, str) or not host:
            return None
        numbers = [n for n in (port, tp, pp) if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if len(numbers) != 3:
            return None
        return cls(engine, host, numbers[0], numbers[1], numbers[2], mode if isinstance(mode, str) else None)

    @functools.cached_property
    def _members(self) -> tuple[bytes, ...]:
        named = {"remote_engine_id": self.engine_id, "remote_host": self.host, "remote_port": self.port}
        if self.transfer_mode is not None:
            named["transfer_mode"] = self.transfer_mode
        return tuple(orjson.dumps({key: value})[1:-1] for key, value in named.items())

    def named_in(self, kv_params: bytes) -> bool:
        """Whether an answer's ``kv_transfer_params`` hold these coordinates, as vLLM writes
        them (compact JSON): a substring test, where a parse would read every block id."""
        return all(member in kv_params for member in self._members)

    def same_server(self, other: Coordinates) -> bool:
        """Whether a WRITE from ``other`` would reach a decode registered with these."""
        return (self.engine_id, self.host, self.port, self.tp_size, self.pp_size) == (
            other.engine_id,
            other.host,
            other.port,
            other.tp_size,
            other.pp_size,
        )

    def decode_kv_params(self, request_id: str) -> bytes:
        """The concurrent decode's ``kv_transfer_params``: registered with this prefill server.

        ``remote_block_ids`` is empty: in push mode the prefill server learns the decode's
        blocks from its registration, not the other way round. ``remote_request_id`` must
        be there (vLLM 0.32's decode engine dies on a KeyError without it, in
        ``NixlConnectorMetadata.add_new_req_to_recv``); the prefill server's own id for the
        request is not known yet, and the decode uses this one only to name the request in
        its lease heartbeats, which the prefill server ignores for an id it does not hold:
        the call's leg id, which both legs carry, is the honest value.
        """
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_block_ids": [],
            "remote_request_id": request_id,
        }
        return orjson.dumps(params)


class CoordinateBook:
    """Each prefill endpoint's coordinates, from its last answer (one book per fleet)."""

    def __init__(self) -> None:
        self._by_url: dict[str, Coordinates] = {}
        self._sequential_only: set[str] = set()
        """Engine ids of prefill servers whose concurrent decodes cannot be trusted: one
        rendered another prompt, or gave no prompt ids to check."""
        self._lock = threading.Lock()

    def learn(self, url: str, kv_params: bytes | None) -> Coordinates | None:
        known = self._by_url.get(url)
        if known is not None and kv_params and known.named_in(kv_params):
            return known  # the same server as last time: no parse on the handoff's path
        coordinates = Coordinates.from_kv_params(kv_params)
        with self._lock:
            if coordinates is None:
                self._by_url.pop(url, None)
            else:
                self._by_url[url] = coordinates
        return coordinates

    def get(self, url: str) -> Coordinates | None:
        return self._by_url.get(url)

    def sequential_only(self, coordinates: Coordinates) -> None:
        """This prefill server gets sequential handoffs only (until it restarts: a new engine id)."""
        with self._lock:
            self._sequential_only.add(coordinates.engine_id)

    def is_sequential_only(self, coordinates: Coordinates) -> bool:
        return coordinates.engine_id in self._sequential_only


__all__ = ["CoordinateBook", "Coordinates"]
