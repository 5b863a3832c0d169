"""One call's migration state: its decode legs' extra fields, why its broken stream cannot
move, the continuations it made and their requests, and the trace of each move."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import orjson

from .. import wire
from .._trace import Migration
from ..pools import Endpoint
from ._continuation import Continuation, Route, continuation_route
from ._tracker import Tracker

if TYPE_CHECKING:
    from ._call import MigratingCall as Call

_TRUE = msgspec.Raw(b"true")
_INCLUDE_USAGE = msgspec.Raw(b'{"include_usage":true}')


def request_field(fields: Mapping[str, msgspec.Raw], name: str) -> Any:
    """The caller's field ``name`` as JSON reads it; None if the request has none."""
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return orjson.loads(memoryview(raw))
    except orjson.JSONDecodeError:
        return raw  # not JSON pdclient can read (an integer beyond 64 bits): present, unknown


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CannotMove(Exception):
    """A migration was begun and cannot go on; the message says why."""


class CallMigration:
    """One call's migration state: whether it can move, its tracker, its moves so far."""

    def __init__(
        self,
        plan: wire.Plan,
        limit: int,
        refused: str | None,
        prompt_ids: bytes | None,
        prompt_count: int,
        *,
        tracked: bool = False,
    ) -> None:
        self.plan = plan
        self.limit = limit
        self.refused = refused
        """Why this call cannot move at all (None: it may)."""
        self.prompt_ids = prompt_ids
        self.prompt_count = prompt_count
        self.caller_wants_ids = request_field(plan.fields, "return_token_ids") is True
        tracked = tracked or refused is None
        self.assembles = tracked and not plan.stream
        """A non-streamed call whose decode leg streams: its body is assembled (``Assembler``)."""
        options = request_field(plan.fields, "stream_options")
        self.wants_usage = self.assembles or (isinstance(options, dict) and options.get("include_usage") is True)
        """The caller's answer ends with a usage report (a streamed one only if asked for)."""
        self._leg_fields: dict[str, msgspec.Raw] = {}
        """What the decode legs of an armed call carry beyond the caller's fields."""
        self.tracker: Tracker | None = None
        if tracked:
            self.tracker = Tracker(
                chat=plan.kind is wire.Kind.CHAT, keep_ids=self.caller_wants_ids, want_prompt_ids=prompt_ids is None
            )
            self._leg_fields["return_token_ids"] = _TRUE
            if self.assembles:
                self._leg_fields.update(stream=_TRUE, stream_options=_INCLUDE_USAGE)
        self.moves: list[Continuation] = []
        self._broken: list[Endpoint] = []
        """The decode endpoints whose stream broke during this call: never a continuation's."""
        self.pending: Continuation | None = None
        """The continuation being opened: ``Call.decode_request`` builds its requests."""
        self._records: list[Migration] = []
        self._open: Continuation | None = None
        self._last_delivery = 0.0

    @property
    def armed(self) -> bool:
        """Its decode stream is tracked (the ids asked for, the events read); it moves only if
        also not ``refused``."""
        return self.tracker is not None

    def decode_body(self, plan: wire.Plan, result: wire.PrefillResult | None) -> bytes:
        """The first decode leg's body: asks for token ids (and a stream) when the call is armed."""
        if self.tracker is None or (self.caller_wants_ids and not self.assembles):
            return wire.decode_body(plan, result)
        fields = wire.decode_fields(plan, result)
        fields.update(self._leg_fields)
        return wire.encode_fields(fields)

    def prompt_tokens(self) -> int | None:
        """The call's prompt length in tokens, once known (from the prefill, or the decode's first chunk)."""
        if self.prompt_ids is not None:
            return self.prompt_count
        tracker = self.tracker
        return len(tracker.prompt_ids) if tracker is not None and tracker.prompt_ids is not None else None

    def usage(self) -> dict[str, int] | None:
        """The answer's usage from the ids pdclient holds (vLLM counts the same tokens), if known."""
        prompt = self.prompt_tokens()
        if prompt is None or self.tracker is None:
            return None
        completion = len(self.tracker.ids)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def ending(self) -> list[bytes]:
        """What a stream cut after its answer ended still owes the caller, as vLLM ends one:
        the usage event (if the caller wants one and has not had it), then ``[DONE]``."""
        tracker = self.tracker
        assert tracker is not None
        out: list[bytes] = []
        usage = self.usage()
        if self.wants_usage and not tracker.usage_sent and usage is not None:
            event_id, created, model = tracker.header or (None, None, None)
            kind = "chat.completion.chunk" if tracker.chat else "text_completion"
            event: dict[str, Any] = {
                "id": event_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            out.append(b"data: " + orjson.dumps(event) + b"\n\n")
        if not tracker.done:
            out.append(b"data: [DONE]\n\n")
        return out

    # -- when a stream breaks ----------------------------------------------------------

    def why_not(self, call: Call) -> str | None:
        """Why the broken stream cannot move now; None if it can."""
        if self.refused is not None:
            return self.refused
        tracker = self.tracker
        assert tracker is not None
        if tracker.stopped is not None:
            return tracker.stopped
        if len(self.moves) >= self.limit:
            return f"max_decode_migrations ({self.limit}) reached"
        if self.prompt_ids is None and tracker.prompt_ids is None:
            return "the prompt's ids are unknown (no prefill ids, and the decode sent none)"
        if not self._others(call):
            return "no other decode endpoint is admitted"
        return None

    def _broken_endpoints(self, call: Call) -> list[Endpoint]:
        return [*self._broken, *([call.decode.endpoint] if call.decode.endpoint is not None else [])]

    def _others(self, call: Call) -> list[Endpoint]:
        broken = self._broken_endpoints(call)
        return [e for e in call.context.fleet.decode.endpoints if e.admits() and e not in broken]

    def begin(self, call: Call, cause: str) -> Continuation:
        """Build the next continuation (raises ``CannotMove`` when the budget is spent)."""
        tracker = self.tracker
        assert tracker is not None
        kept = tracker.ids
        if self.prompt_ids is None:
            assert tracker.prompt_ids is not None
            self.prompt_ids, self.prompt_count = orjson.dumps(tracker.prompt_ids), len(tracker.prompt_ids)
        fields = dict(self.plan.fields)
        for name in ("max_tokens", "max_completion_tokens"):
            budget = request_field(fields, name)
            if _is_int(budget):
                left = budget - len(kept)
                if left < 1:
                    raise CannotMove(f"{name} ({budget}) is spent")
                fields[name] = msgspec.Raw(b"%d" % left)
        least = request_field(fields, "min_tokens")
        if _is_int(least) and least > 0:
            fields["min_tokens"] = msgspec.Raw(b"%d" % max(0, least - len(kept)))
        fields.update(self._leg_fields)
        ids = self.prompt_ids
        assert ids is not None
        if kept:
            ids = ids[:-1] + b"," + orjson.dumps(kept)[1:]
        count = self.prompt_count + len(kept)
        if call.decode.endpoint is not None:
            self._broken.append(call.decode.endpoint)
        continuation = Continuation(
            plan=dataclasses.replace(self.plan, fields=fields),
            ids=ids,
            count=count,
            route=continuation_route(count),
            after_tokens=len(kept),
            from_url=call.decode.url,
            cause=cause,
            request_id=f"{call.leg_request_id}-m{len(self.moves) + 1}",
        )
        self.moves.append(continuation)
        self._finish_record()
        return continuation

    def prefill_request(self, call: Call, continuation: Continuation) -> httpx.Request:
        """The continuation's prefill leg (route prefill+decode): another prefill attempt of the call."""
        leg = call.prefill
        leg.pick(call.route_for("prefill"))
        body = continuation.prefill_body()
        request = call.requests.signed(leg.url, body, call.deadline)
        request.headers["x-request-id"] = continuation.request_id
        request.headers["accept"] = "application/json"
        return leg.start(request)

    def read_prefill(self, continuation: Continuation, response: httpx.Response) -> None:
        """Keep the continuation prefill's KV parameters, or fall back to the decode route."""
        if response.status_code != 200:
            continuation.note = f"its prefill answered HTTP {response.status_code}"
        else:
            result = wire.read_prefill(self.plan.kind, response.content)
            if result.ids is None or result.count != continuation.count:
                continuation.note = f"its prefill's ids were not the continuation's ({result.problem})"
            else:
                continuation.result = result
                return
        continuation.route = Route.DECODE

    def continuation_request(self, call: Call) -> httpx.Request:
        """The pending continuation's decode request, on an admitted endpoint that has not broken."""
        continuation = self.pending
        assert continuation is not None
        leg = call.decode
        leg.pick(call.route_for("decode"), exclude=self._broken_endpoints(call))
        body = continuation.decode_body()
        request = call.requests.signed(leg.url, body)
        request.headers["x-request-id"] = continuation.request_id
        return request

    def release_body(self, continuation: Continuation) -> bytes | None:
        result = continuation.result
        if result is None or not result.holds_remote_kv:
            return None
        return wire.release_body(continuation.plan, result)

    def moved(self, call: Call, continuation: Continuation) -> None:
        """The continuation answered 200: its events are spliced into the caller's stream."""
        assert self.tracker is not None
        self.tracker.splice(self.prompt_count)
        self._open = continuation
        continuation.to_url = call.decode.url

    # -- delivery and the trace --------------------------------------------------------

    def delivered(self, now: float) -> None:
        """Bytes just went to the caller: the first after a move ends its pause."""
        if self._open is not None:
            self._finish_record(pause_ms=(now - self._last_delivery) * 1000)
        self._last_delivery = now

    def broke(self, now: float) -> None:
        """The stream broke: a pause starts at the last delivery (or now, if nothing was delivered)."""
        if not self._last_delivery:
            self._last_delivery = now

    def _finish_record(self, pause_ms: float | None = None) -> None:
        continuation, self._open = self._open, None
        if continuation is not None:
            self._records.append(_record(continuation, pause_ms))

    def records(self) -> tuple[Migration, ...]:
        if self._open is None:
            return tuple(self._records)
        return (*self._records, _record(self._open, None))

    def summary(self) -> str | None:
        records = self.records()
        if not records:
            return None
        moves = ", ".join(f"{r.from_url} -> {r.to_url} after {r.after_tokens} tokens" for r in records)
        return f"decode stream moved ({moves})"


def _record(continuation: Continuation, pause_ms: float | None) -> Migration:
    cause = continuation.cause if continuation.note is None else f"{continuation.cause} ({continuation.note})"
    return Migration(
        from_url=continuation.from_url,
        to_url=continuation.to_url,
        after_tokens=continuation.after_tokens,
        pause_ms=pause_ms,
        route=continuation.route.value,
        cause=cause,
    )
