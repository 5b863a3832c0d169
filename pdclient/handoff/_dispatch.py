"""Concurrent dispatch: the decode leg sent with the prefill leg, for vLLM's push mode.

In vLLM's pull mode (``NixlConnector``) the decode server needs the prefill's answer (its
block ids) before it can pull the KV, so the legs go one after the other. In push mode
(``NixlPushConnector``) the decode server registers its freshly allocated blocks with the
prefill server and waits; the prefill server WRITEs the KV into them as its prefill ends,
matched by the base request id (both legs carry the call's ``X-Request-Id``). The decode
only needs the prefill server's coordinates up front: ``remote_engine_id``,
``remote_host``, ``remote_port``, ``tp_size``. They are stable per prefill server and come
back in each of its answers' ``kv_transfer_params``, with ``transfer_mode`` (``"push"`` /
``"pull"``) saying which mode it runs. So the decode can render the prompt and allocate its
blocks while the prefill computes, and its first token follows the WRITE.

What is learnt, and when a call goes concurrent (``PDOptions.dispatch``):

- Every prefill answer (sequential or concurrent) records its endpoint's coordinates in
  the fleet's ``CoordinateBook``, keyed by the endpoint's URL; an answer without them
  forgets the endpoint.
- ``"auto"``: concurrent when the endpoint's last answer gave coordinates and said
  ``transfer_mode: "push"``; ``"concurrent"``: when it gave coordinates and did not say
  ``"pull"`` (for servers that do not report their mode). Otherwise, and for the first
  call to an endpoint, sequential.
- After the prefill answers, its coordinates are compared with those the decode was sent:
  a prefill server restarted since (a new engine id) or a retry on another endpoint never
  WRITEs into that decode's blocks, so the decode is cancelled and sent again sequentially
  with the prefill's own ``kv_transfer_params`` (the next call uses the new coordinates).

Failures: a prefill that fails for good cancels the decode (closing its connection, which
aborts it in vLLM; the decode server's ``push_registration_timeout`` is only the backstop)
and the call goes on as the failure policy says; a decode that fails or answers an error
is sent again sequentially once the prefill answered (that decode takes the KV and frees
the prefill's blocks, or gets the error a sequential call would). vLLM 0.32's decode
server keeps the blocks of an aborted decode whose registration went out until a WRITE
reaches them (its receiving side has no lease: vLLM issue #46283), so a caller that leaves
cuts the decode at once but not the prefill: the async transport reads it to its end in a
task of its own, and its WRITE frees the cut decode's blocks. A sync caller leaves only
by an exception in its own thread (Ctrl-C), which cuts the prefill's read with the decode:
the blocks then wait as after a failed prefill. After a prefill that fails for good no
WRITE comes, and those blocks stay held until vLLM fixes it.

In concurrent mode the decode server renders the prompt itself (no ids are forwarded: they
are not known yet), so both servers must run the same model and chat template. vLLM does
not check that: a decode whose prompt has fewer blocks than the prefill's gets the WRITE of
the prefill's last blocks (``push_worker._apply_prefix_caching`` trims to the decode's
count), one with more trips an assertion in the prefill server's worker. So a concurrent
decode asks for its prompt ids (``return_token_ids``; the tracker strips them again), and
the transport reads its first event before the caller gets a byte (``PromptPeek``). Ids
that differ from the prefill's are template drift: the decode is cancelled and sent again
computing the prefill's ids itself (the prefill's KV went into the cancelled decode's
blocks), and that prefill engine gets only sequential handoffs from then on (which forward
the prefill's ids, so the decode's template never matters), until it restarts with a new
engine id. Only chat and completions are checked this way, and only they go concurrent:
the Responses and Messages events carry no ids to check, and vLLM's Responses route runs
its engine request under the body's ``request_id``, which no leg id can pair with, so
those calls stay sequential in every mode.

The transports (``transport._transport``) run the two legs; this module decides and builds.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import orjson

from .. import wire
from ..pools import AllEndpointsOpen
from ..wire import EventTooLarge, SSEFramer, event_data, is_done

if TYPE_CHECKING:
    import httpx

    from ..fleet import Fleet
    from ._call import Call

SEQUENTIAL = "sequential"
CONCURRENT = "concurrent"

# Why a concurrent decode went out again sequentially (``PDTrace.dispatch_fallback``).
PREFILL_MOVED = "prefill_moved"
DECODE_FAILED = "decode_failed"
PROMPT_DRIFT = "prompt_drift"
PROMPT_UNCHECKED = "prompt_unchecked"


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


_books: weakref.WeakKeyDictionary[Fleet, CoordinateBook] = weakref.WeakKeyDictionary()
_books_lock = threading.Lock()


def book_of(fleet: Fleet) -> CoordinateBook:
    """The fleet's coordinate book: shared by every copy of a client that shares the fleet."""
    with _books_lock:
        book = _books.get(fleet)
        if book is None:
            book = _books[fleet] = CoordinateBook()
        return book


def mode_of(call: Call) -> str:
    assert call.plan is not None
    return call.plan.options.dispatch or call.context.options.dispatch


def usable(mode: str, coordinates: Coordinates | None) -> bool:
    """Whether ``mode`` sends a decode concurrently to a prefill endpoint known by ``coordinates``."""
    if mode == SEQUENTIAL or coordinates is None:
        return False
    if mode == "auto":
        return coordinates.transfer_mode == "push"
    return coordinates.transfer_mode != "pull"


@dataclass
class ConcurrentDecode:
    """A decode leg sent before its prefill answered: registered with ``coordinates``."""

    coordinates: Coordinates
    request: httpx.Request


def concurrent_decode(call: Call) -> ConcurrentDecode | None:
    """The decode request to send now, with the prefill, or None: the call is sequential.

    Decided once a call gets a prefill leg. The prefill endpoint is picked here (the
    decode must name it); the prefill's first attempt goes to it (``Leg.pick_ahead``).
    """
    call.dispatch = SEQUENTIAL
    plan = call.plan
    if plan is None or call.fallback_url is not None or mode_of(call) == SEQUENTIAL:
        return None
    if not call.decode_admitted():
        return None  # the prefill phase answers a decode outage
    try:
        prefill_url = call.prefill.pick_ahead(call.route_for("prefill"))
    except AllEndpointsOpen:
        return None  # the prefill phase reports it as usual
    book = book_of(call.context.fleet)
    coordinates = book.get(prefill_url)
    if not usable(mode_of(call), coordinates):
        return None
    assert coordinates is not None
    if book.is_sequential_only(coordinates):
        return None  # a decode's prompt for this prefill server differed, or could not be checked
    assert call.dialect is not None
    if call.dialect.migration_refusal is not None:
        # Its events carry no prompt ids to check the decode's rendering against, and vLLM's
        # Responses route runs its engine request under the body's ``request_id`` (the
        # caller's, or one of vLLM's), not the legs' id the decode's registration names.
        return None
    try:
        base = call.decode.pick(call.route_for("decode"))
    except AllEndpointsOpen:
        return None  # the sequential path answers a decode outage
    pushed = wire.PrefillResult(ids=None, count=0, kv_transfer_params=coordinates.decode_kv_params(call.leg_request_id))
    body = call.armed_decode_body(pushed, checks_prompt=True)
    request = call.decode.start(call.requests.signed(base, body))
    call.dispatch = CONCURRENT
    return ConcurrentDecode(coordinates, request)


def learn(call: Call) -> Coordinates | None:
    """Record the coordinates the prefill answer gave for its endpoint (every call, either mode)."""
    result = call.prefill_result
    if result is None or not call.prefill.url:
        return None
    return book_of(call.context.fleet).learn(call.prefill.url, result.kv_transfer_params)


def moved_on(call: Call, sent: ConcurrentDecode) -> str | None:
    """Why the decode sent with the prefill will never receive its KV, or None: it will.

    Called once the prefill phase is over (its answer's coordinates learnt by
    ``Call.check_prefill``): the prefill failed, or it ran on a server other than the one
    the decode registered with.
    """
    if call.prefill_result is None:
        return "the prefill failed"
    answered = book_of(call.context.fleet).get(call.prefill.url)
    if answered is None or not answered.same_server(sent.coordinates):
        call.dispatch_fallback = PREFILL_MOVED
    if answered is None:
        return "the prefill's answer gave no push coordinates"
    if not answered.same_server(sent.coordinates):
        return (
            f"the prefill server's coordinates changed (engine {sent.coordinates.engine_id} -> "
            f"{answered.engine_id}, a restart or another endpoint)"
        )
    return None


class PromptPeek:
    """The first event of a concurrent decode's stream, read before the caller gets a byte:
    the prompt ids the decode rendered (``prompt_token_ids``, top level in a chat chunk, in
    the choice in a completions one). ``feed`` the bytes read until it says it is decided."""

    __slots__ = ("_chat", "_framer", "ids")

    def __init__(self, *, chat: bool) -> None:
        self._chat = chat
        self._framer = SSEFramer()
        self.ids: list[int] | None = None

    def feed(self, data: bytes) -> bool:
        """Whether the first event with data has been read (or the stream is not one vLLM writes)."""
        try:
            events = self._framer.feed(data)
        except EventTooLarge:
            return True  # not vLLM's: the caller's body then fails the call, naming the bound
        for event in events:
            payload = event_data(event)
            if payload is None:
                continue  # a comment: the next event says
            if not is_done(payload):
                self._read(payload)
            return True
        return False

    def _read(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        if not self._chat:
            choices = obj.get("choices")
            obj = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        ids = obj.get("prompt_token_ids")
        if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
            self.ids = ids


def prompt_peek(call: Call) -> PromptPeek:
    assert call.plan is not None
    return PromptPeek(chat=call.plan.kind is wire.Kind.CHAT)


def prompt_drift(call: Call, sent: ConcurrentDecode, decode_prompt: list[int] | None) -> str | None:
    """Why the concurrent decode's answer is not the handoff's (the prompt it rendered differs
    from the prefill's ids, or it gave none to check: a decode server, or something on the
    way, that does not pass ``return_token_ids`` on), or None: it is. Either way that prefill
    server gets sequential handoffs from then on. A prefill that sent no ids leaves nothing
    to check, as in a sequential handoff without them."""
    result = call.prefill_result
    if result is None or result.ids is None or call.migration is None or not call.migration.armed:
        return None
    book = book_of(call.context.fleet)
    if decode_prompt is None:
        book.sequential_only(sent.coordinates)
        call.dispatch_fallback = PROMPT_UNCHECKED
        return "the decode's first event carried no prompt ids to check it against the prefill's"
    prefill_prompt = orjson.loads(result.ids)
    if decode_prompt == prefill_prompt:
        return None
    at = next((i for i, (a, b) in enumerate(zip(decode_prompt, prefill_prompt, strict=False)) if a != b), None)
    where = f", first at token {at}" if at is not None else ""
    why = (
        f"the decode rendered another prompt than the prefill ({len(decode_prompt)} tokens against "
        f"{len(prefill_prompt)}{where}): do both servers run the same model and chat template?"
    )
    book.sequential_only(sent.coordinates)
    call.dispatch_fallback = PROMPT_DRIFT
    return why


def fall_back(call: Call, why: str, *, kv_spent: bool = False) -> None:
    """The concurrent decode was cancelled or failed: the call's decode goes out anew, sequentially.

    ``kv_spent``: the decode had answered, so the prefill server has WRITTEN its KV into
    that decode's blocks and freed its own; the new decode computes the prefill's ids itself.
    """
    call.dispatch = SEQUENTIAL  # what answers is a sequential decode
    call.dispatch_fallback = call.dispatch_fallback or DECODE_FAILED
    call.migration = None
    call.reset_decode_body()
    if kv_spent and call.prefill_result is not None:
        call.prefill_result = dataclasses.replace(call.prefill_result, kv_transfer_params=None)
    note = f"concurrent dispatch fell back to sequential: {why}"
    call.fallback = f"{call.fallback}; {note}" if call.fallback else note


__all__ = [
    "CONCURRENT",
    "DECODE_FAILED",
    "PREFILL_MOVED",
    "PROMPT_DRIFT",
    "PROMPT_UNCHECKED",
    "SEQUENTIAL",
    "ConcurrentDecode",
    "CoordinateBook",
    "Coordinates",
    "PromptPeek",
    "book_of",
    "concurrent_decode",
    "fall_back",
    "learn",
    "moved_on",
    "prompt_drift",
    "prompt_peek",
    "usable",
]
