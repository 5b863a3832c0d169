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
- ``"auto"``: where the endpoint's last answer gave coordinates and said
  ``transfer_mode: "push"``, the cost model decides (``costs.DispatchChooser``): each
  mode's time to first token is learnt on that endpoint, concurrent is taken where it is
  predicted the faster, the other mode is probed once in a while, and two coordinate
  changes in 5 min make the endpoint sequential for 10. ``"concurrent"``: whenever the
  answer gave coordinates and did not say ``"pull"`` (for servers that do not report their
  mode). Otherwise, and for the first call to an endpoint, sequential.
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
cuts the decode at once but not the prefill: the async driver reads it to its end in a
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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from .. import wire
from ..fleet import CoordinateBook, Coordinates
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


def learn_coordinates(fleet: Fleet, prefill_url: str, kv_transfer_params: bytes | None) -> None:
    """Where a prefill endpoint's NIXL agent is, from every answer it gives (either mode);
    two changes in a while make ``dispatch="auto"`` sequential there (``CostModel.coordinates``)."""
    learnt = fleet.coordinates.learn(prefill_url, kv_transfer_params)
    if learnt is not None:
        fleet.costs.coordinates(prefill_url, learnt.engine_id, time.monotonic())


def mode_of(call: Call) -> str:
    return call.effective.dispatch


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
    in_flight: Any = None
    """The driver's handle on the decode while it runs (a thread's or a task's)."""


def concurrent_decode(call: Call) -> ConcurrentDecode | None:
    """The decode request to send now, with the prefill, or None: the call is sequential.

    Decided once a call gets a prefill leg. The prefill endpoint is picked here (the
    decode must name it); the prefill's first attempt goes to it (``Leg.pick_ahead``).
    """
    call.record.dispatch = SEQUENTIAL
    plan = call.plan
    if plan is None or call.fallback_url is not None or mode_of(call) == SEQUENTIAL:
        return None
    assert call.dialect is not None
    if call.dialect.migration_refusal is not None:
        # Its events carry no prompt ids to check the decode's rendering against, and vLLM's
        # Responses route runs its engine request under the body's ``request_id`` (the
        # caller's, or one of vLLM's), not the legs' id the decode's registration names.
        return None
    if not call.context.fleet.decode.admitted():
        return None  # the prefill phase answers a decode outage
    try:
        prefill_url = call.prefill.pick_ahead(call.route_for("prefill"))
    except AllEndpointsOpen:
        return None  # the prefill phase reports it as usual
    book = call.context.fleet.coordinates
    coordinates = book.get(prefill_url)
    if not usable(mode_of(call), coordinates):
        return None
    assert coordinates is not None
    if book.is_sequential_only(coordinates):
        return None  # a decode's prompt for this prefill server differed, or could not be checked
    if mode_of(call) == "auto":
        tokens = call.remote.handoff_tokens(plan, call.context.fleet.memory)
        choice = call.context.fleet.costs.choose_dispatch(prefill_url, tokens, time.monotonic())
        call.record.dispatch_choice = choice
        if choice.mode == SEQUENTIAL:
            return None
    try:
        base = call.decode.pick(call.route_for("decode"))
    except AllEndpointsOpen:
        return None  # the sequential path answers a decode outage
    pushed = wire.PrefillResult(ids=None, count=0, kv_transfer_params=coordinates.decode_kv_params(call.leg_request_id))
    body = call.armed_decode_body(pushed, checks_prompt=True)
    request = call.decode.start(call.requests.signed(base, body))
    call.record.dispatch = CONCURRENT
    return ConcurrentDecode(coordinates, request)


@dataclass(frozen=True, slots=True)
class FallBack:
    """Why a concurrent decode cannot be the call's answer: ``why`` for people, ``reason`` for
    programs (``PDTrace.dispatch_fallback``). The flow then sends the decode again, sequentially."""

    why: str
    reason: str = DECODE_FAILED


def moved_on(prefill: wire.PrefillResult | None, answered: Coordinates | None, sent: Coordinates) -> FallBack | None:
    """Whether the decode sent with the prefill will never receive its KV (None: it will).

    Asked once the prefill phase is over, with its answer (None: it failed) and the
    coordinates that answer gave its endpoint (``Call.check_prefill`` learnt them): the
    prefill failed, or it ran on a server other than the one the decode registered with.
    """
    if prefill is None:
        return FallBack("the prefill failed")
    if answered is None:
        return FallBack("the prefill's answer gave no push coordinates", PREFILL_MOVED)
    if not answered.same_server(sent):
        return FallBack(
            f"the prefill server's coordinates changed (engine {sent.engine_id} -> "
            f"{answered.engine_id}, a restart or another endpoint)",
            PREFILL_MOVED,
        )
    return None


def failure(response: httpx.Response | None, error: BaseException | None) -> FallBack | None:
    """Whether a concurrent decode's outcome cannot be the caller's answer (None: it can)."""
    if error is not None:
        return FallBack(f"the decode failed: {type(error).__name__}: {error}".rstrip(": "))
    if response is None:
        return FallBack("the decode gave no answer")
    if response.status_code >= 400:
        return FallBack(f"the decode answered HTTP {response.status_code}")
    return None


def broke_early(error: BaseException) -> FallBack:
    why = f"the decode's stream broke before its first event: {type(error).__name__}: {error}"
    return FallBack(why.rstrip(": "))


class DecodeCancelled(Exception):
    """How a cancelled concurrent decode's leg ends: by the client's choice, saying nothing of its server."""


def discarded(status: int | None, error: BaseException | None) -> tuple[int | None, BaseException | None]:
    """What the cut decode's leg ends with: the status of the response it had, else its error or the cut."""
    if status is not None:
        return status, None
    return None, error or DecodeCancelled("cancelled: its prefill failed or ran elsewhere")


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


def prompt_drift(
    book: CoordinateBook, sent: Coordinates, prefill_ids: bytes | None, decode_prompt: list[int] | None
) -> FallBack | None:
    """Whether the concurrent decode's answer is not the handoff's: the prompt it rendered
    differs from the prefill's ids, or it gave none to check (a decode server, or something
    on the way, that does not pass ``return_token_ids`` on). Either way that prefill server
    gets sequential handoffs from then on (``book``). No prefill ids to check against
    (``prefill_ids`` None: none sent, or the call's stream is not tracked) leaves nothing to
    check, as in a sequential handoff without them."""
    if prefill_ids is None:
        return None
    if decode_prompt is None:
        book.sequential_only(sent)
        return FallBack(
            "the decode's first event carried no prompt ids to check it against the prefill's", PROMPT_UNCHECKED
        )
    prefill_prompt = orjson.loads(prefill_ids)
    if decode_prompt == prefill_prompt:
        return None
    at = next((i for i, (a, b) in enumerate(zip(decode_prompt, prefill_prompt, strict=False)) if a != b), None)
    where = f", first at token {at}" if at is not None else ""
    book.sequential_only(sent)
    return FallBack(
        f"the decode rendered another prompt than the prefill ({len(decode_prompt)} tokens against "
        f"{len(prefill_prompt)}{where}): do both servers run the same model and chat template?",
        PROMPT_DRIFT,
    )


__all__ = [
    "CONCURRENT",
    "DECODE_FAILED",
    "PREFILL_MOVED",
    "PROMPT_DRIFT",
    "PROMPT_UNCHECKED",
    "SEQUENTIAL",
    "ConcurrentDecode",
    "DecodeCancelled",
    "FallBack",
    "CoordinateBook",
    "Coordinates",
    "PromptPeek",
    "broke_early",
    "concurrent_decode",
    "discarded",
    "failure",
    "learn_coordinates",
    "moved_on",
    "prompt_drift",
    "prompt_peek",
    "usable",
]
