"""Token-exact decode migration: a decode stream cut mid-answer continues elsewhere.

The decisions and the bytes, no I/O (the streams that send the continuation are in
``handoff._decode_body.MovingBody``). One ``CallMigration`` per P/D call, made when its decode body is built:

- **arming** (``arm``): a call can move only if its prompt ids are known, the pool has
  another decode endpoint, ``max_decode_migrations`` > 0, and nothing in the request makes
  a continuation inexact (``static_refusal``). An unarmed call goes as before (no token ids
  asked for, no event parsed) and the reason goes into the error if its stream breaks.
- **non-streamed calls** (``Assembler``, ``PDOptions.migrate_non_streamed``, off by
  default): an armed call that did not ask for a stream streams its decode leg all the same
  (``stream: true``, ``stream_options.include_usage``), so that it can move like any other,
  and the caller gets the JSON body vLLM would have answered, assembled from the events.
- **tracking** (``Tracker``): an armed call's decode leg carries ``return_token_ids: true``;
  vLLM then puts each chunk's generated ids in ``choices[0].token_ids`` (and the prompt's in
  the first chunk). The tracker splits the SSE body into events, keeps the ids of every
  chunk it passed on, and strips ``token_ids`` / ``prompt_token_ids`` (unless the caller
  asked for them) by cutting them out of the event's bytes. A chunk that carries ids but
  no text (a character split across tokens, a special token) is held back until the next
  chunk with text, so at any moment the ids kept are exactly those whose text the caller
  has: a cut drops the held chunks and the new server generates those tokens again.
- **continuing** (``Continuation``): the prompt ids plus the kept ids become the prompt
  (``kv_transfer_params.prompt_token_ids`` on chat, the id ``prompt`` on completions),
  with the caller's sampling fields and ``max_tokens`` / ``max_completion_tokens`` /
  ``min_tokens`` reduced by what was generated. ``continuation_route`` says whether the
  decode endpoint computes that prompt itself or a prefill endpoint does first.
- **splicing** (``Tracker.splice``): the continuation's events reach the caller under the
  original ``id``, ``created`` and ``model``; its role chunk is dropped; ``usage`` counts
  the original prompt and the whole answer once.
- **an ended answer** (``Tracker.answered``): once every choice has sent its
  ``finish_reason`` the answer is whole; a cut after that never moves (a continuation
  would append a second answer). The stream is ended as vLLM ends one: the usage event if
  the caller asked for usage and had not got it, then ``[DONE]`` (``CallMigration.ending``).

Prior art: NVIDIA Dynamo replays the generated token ids to a new worker
(``--migration-limit``, ai-dynamo/dynamo#1930) and refuses guided decoding
(ai-dynamo/dynamo#7930); llm-d proposes the same for its router (llm-d/llm-d-router#2345).
See docs/ARCHITECTURE.md, "Decode migration".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import orjson

from .. import wire
from .._trace import Migration
from ..pools import Endpoint
from ..wire import ParsedEvent, SSEFramer, event_data, is_done

if TYPE_CHECKING:
    from ._call import MigratingCall as Call

REMOTE_PREFILL_MIN_TOKENS = 1024
"""A continuation whose prompt (the call's prompt plus the answer so far) has at least this
many tokens is computed by a prefill endpoint and handed over; a shorter one by the decode
endpoint itself. See ``continuation_route``."""

_TRUE = msgspec.Raw(b"true")
_INCLUDE_USAGE = msgspec.Raw(b'{"include_usage":true}')
_TOKEN_IDS = b',"token_ids":'
_PROMPT_TOKEN_IDS = b',"prompt_token_ids":'
_PROMPT_KEY = b'"prompt_token_ids":'
# Request fields whose vLLM implementation makes a continuation differ from the answer
# the server would have given, or whose value is compared below.
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class Route(str, enum.Enum):
    """Where a continuation's prompt is computed."""

    DECODE = "decode"
    PREFILL_DECODE = "prefill+decode"


def continuation_route(prompt_tokens: int) -> Route:
    """Where to compute a continuation whose prompt has ``prompt_tokens`` tokens.

    Short: on the new decode endpoint itself. One request, no KV transfer and no NIXL
    handshake with a prefill server that endpoint may not have met yet; a short prefill
    delays the other streams on that server by about one step. Long: on a prefill
    endpoint, whose KV is handed over as for a new call, so a long prefill does not stall
    every stream of the decode server (the reason for P/D). Dynamo's conditional
    disaggregation makes the same cut ("if the prefill is short ... prefill locally in the
    decode engine"). Issue 11's estimate (the decode's prefix-cache hit, the queue) can
    replace the threshold here.
    """
    return Route.PREFILL_DECODE if prompt_tokens >= REMOTE_PREFILL_MIN_TOKENS else Route.DECODE


def _get(fields: Mapping[str, msgspec.Raw], name: str) -> Any:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return orjson.loads(memoryview(raw))
    except orjson.JSONDecodeError:
        return raw  # not JSON pdclient can read (an integer beyond 64 bits): present, unknown


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def static_refusal(plan: wire.Plan) -> str | None:
    """Why no continuation of this request could be exact, from the request alone; None if one can."""
    fields = plan.fields
    if not plan.stream and _get(fields, "stream_options") is not None:
        # vLLM refuses stream_options on a non-streamed call: the caller gets that 400 as before.
        return "stream_options on a non-streamed call"
    if plan.ids_skipped is not None:
        return f"the prompt's ids are not forwarded ({plan.ids_skipped})"
    n = _get(fields, "n")
    if n not in (None, 1):
        return "n > 1 (one continuation per choice is not supported)"
    best_of = _get(fields, "best_of")
    if best_of not in (None, 1):
        return "best_of > 1"
    if _get(fields, "stop"):
        return "stop strings (one may span the cut, and vLLM holds back the text that could start one)"
    tools = _get(fields, "tools")
    if tools and _get(fields, "tool_choice") != "none":
        return "tools offered (a tool call cannot be continued, and the tool parser holds back text)"
    response_format = _get(fields, "response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured output (guided decoding would restart at the schema's root)"
    if any(_get(fields, name) is not None for name in _GUIDED_FIELDS):
        return "structured output (guided decoding would restart at the schema's root)"
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(fields, name) not in (None, 0, 0.0):
            return f"{name} (vLLM counts it over generated tokens only; they would become prompt)"
    if _get(fields, "bad_words"):
        return "bad_words (a banned sequence may span the cut)"
    if _get(fields, "prompt_logprobs") is not None:
        return "prompt_logprobs"
    if plan.kind is wire.Kind.COMPLETIONS and _get(fields, "logprobs") is not None:
        return "completions logprobs (their text offsets restart at the cut)"
    if _get(fields, "seed") is not None and _get(fields, "temperature") not in (0, 0.0):
        return "a seeded sample (a continuation cannot replay the seed's random stream)"
    if _get(fields, "truncate_prompt_tokens") is not None:
        return "truncate_prompt_tokens (would cut the continuation's prompt)"
    if _get(fields, "logits_processors"):
        return "custom logits processors"
    return None


def arm(call: Call, *, tracked: bool = False) -> CallMigration:
    """Whether this call's decode stream may move, decided when its decode body is built;
    ``tracked``: its stream is tracked even if it may not (its prompt ids are wanted)."""
    assert call.plan is not None
    plan, options = call.plan, call.context.options
    limit = call.effective.max_decode_migrations
    prompt_ids: bytes | None = None
    prompt_count = 0
    result = call.prefill_result
    if result is not None and result.ids is not None:
        prompt_ids, prompt_count = result.ids, result.count
    reason: str | None
    if limit == 0:
        reason = "max_decode_migrations is 0"
    elif not plan.stream and not options.migrate_non_streamed:
        # Its decode leg would have to stream, which costs the decode server's API process
        # more CPU on every call; off, the openai SDK's max_retries repeats a failed one whole.
        reason = "not streamed (migrate_non_streamed is off)"
    elif len(call.context.fleet.decode.endpoints) < 2:
        reason = "no other decode endpoint (decode_base_url lists one)"
    elif call.fallback_url is not None:
        reason = "sent to the fallback server"
    else:
        reason = static_refusal(plan)
    return CallMigration(plan, limit, reason, prompt_ids, prompt_count, tracked=tracked)


class CannotMove(Exception):
    """A migration was begun and cannot go on; the message says why."""


@dataclasses.dataclass
class Continuation:
    """One continuation of a call: its request body (per route) and where it came from."""

    number: int
    plan: wire.Plan
    """The caller's plan with the continuation's fields (budget reduced, ids asked for)."""
    ids: bytes
    """The continuation's prompt: the call's prompt ids and the kept ids, a JSON array."""
    count: int
    route: Route
    after_tokens: int
    from_url: str
    cause: str
    request_id: str
    to_url: str = ""
    result: wire.PrefillResult | None = None
    """The continuation's prefill answer (route prefill+decode), or the ids alone."""
    note: str | None = None
    """Why the route changed on the way (the prefill failed)."""

    def decode_body(self) -> bytes:
        result = self.result or wire.PrefillResult(self.ids, self.count, None)
        return wire.decode_body(self.plan, result)

    def prefill_body(self) -> bytes:
        return wire.prefill_body_for_ids(self.plan, self.ids)


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
        self.caller_wants_ids = _get(plan.fields, "return_token_ids") is True
        tracked = tracked or refused is None
        self.assembles = tracked and not plan.stream
        """A non-streamed call whose decode leg streams: its body is assembled (``Assembler``)."""
        options = _get(plan.fields, "stream_options")
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
        self._started_first = False

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
            budget = _get(fields, name)
            if _is_int(budget):
                left = budget - len(kept)
                if left < 1:
                    raise CannotMove(f"{name} ({budget}) is spent")
                fields[name] = msgspec.Raw(b"%d" % left)
        least = _get(fields, "min_tokens")
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
            number=len(self.moves) + 1,
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


# -- the SSE body --------------------------------------------------------------------------


def _whole(event: bytes) -> list[bytes]:
    return [event] if event else []


class Tracker:
    """An armed call's SSE body, event by event: the ids the caller has, and the bytes it gets."""

    __slots__ = (
        "_framer",
        "_held",
        "_held_ids",
        "_splice",
        "chat",
        "choices",
        "done",
        "finished",
        "header",
        "ids",
        "keep_ids",
        "prompt_ids",
        "stopped",
        "usage_sent",
        "want_prompt_ids",
    )

    def __init__(self, *, chat: bool, keep_ids: bool, want_prompt_ids: bool, choices: int = 1) -> None:
        self.chat = chat
        self.choices = choices
        """How many choices the answer has (``n``); each one finishes on its own."""
        self.finished: dict[int, str] = {}
        """The ``finish_reason`` of each choice that sent one to the caller, by its index."""
        self.usage_sent = False
        """The final usage event (``choices: []``) went to the caller."""
        self.keep_ids = keep_ids
        """The caller asked for token ids: pass them on."""
        self.want_prompt_ids = want_prompt_ids
        """No prefill ids (the prefill failed): keep the decode's own, from its first chunk."""
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        """Generated ids whose chunks reached the caller, in order."""
        self.stopped: str | None = None
        """Why the stream can no longer move (a tool call started, ...); None while it can."""
        self.done = False
        """``[DONE]`` went to the caller."""
        self.header: tuple[Any, Any, Any] | None = None
        """The original stream's ``id``, ``created`` and ``model``."""
        self._framer = SSEFramer()
        self._held: list[bytes] = []
        self._held_ids: list[int] = []
        self._splice: _Splice | None = None

    def feed(self, data: bytes) -> bytes:
        """The body bytes just read; returns what goes to the caller now (whole events)."""
        return b"".join(self.events(data))

    def events(self, data: bytes) -> list[bytes]:
        """The body bytes just read; returns the events that go to the caller now, each whole
        and framed once (the caller's body takes them as they are: ``handoff.CallerBody``)."""
        return [piece for event in self._framer.feed(data) for piece in self._event(event)]

    def end(self) -> list[bytes]:
        """The body ended without ``[DONE]``: what is left, as it is."""
        rest = self._framer.rest()
        return [*self._flush(), rest] if rest else self._flush()

    @property
    def answered(self) -> bool:
        """Every choice has sent its ``finish_reason``: the answer is whole, whatever follows."""
        return len(self.finished) >= self.choices

    def cut(self) -> None:
        """The stream broke: drop what was not passed on (held chunks, a partial event)."""
        self._framer.rest()
        self._held.clear()
        self._held_ids.clear()

    def splice(self, prompt_tokens: int) -> None:
        """From now on the events are a continuation's: rewrite them into the caller's stream."""
        self._splice = _Splice(self.header, prompt_tokens, len(self.ids), self.chat, self.keep_ids)

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason

    def _flush(self) -> list[bytes]:
        if not self._held:
            return []
        self.ids.extend(self._held_ids)
        self._held_ids.clear()
        held, self._held = self._held, []
        return held

    def _event(self, event: bytes) -> list[bytes]:
        payload = event_data(event)
        if payload is None:
            return [event]  # a comment, or a field vLLM does not send: as it is
        if len(payload) < 16 and is_done(payload):
            self.done = True
            return [*self._flush(), event]
        original = event
        if not self.want_prompt_ids and _PROMPT_KEY in payload:
            # The first chunk's prompt ids (thousands, with a long prompt) are cut out of the
            # bytes before parsing: pdclient has them already.
            cut = _cut(event, _PROMPT_TOKEN_IDS)
            if cut:
                event = cut
                payload = event_data(cut) or b""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._stop("the decode sent an event that is not JSON")
            return [*self._flush(), event]
        if type(obj) is not dict:
            self._stop("the decode sent an event that is not a JSON object")
            return [*self._flush(), event]
        if self.header is None:
            self.header = (obj.get("id"), obj.get("created"), obj.get("model"))
        choices = obj.get("choices")
        choice = choices[0] if type(choices) is list and choices and type(choices[0]) is dict else None
        if "error" in obj:
            self._stop("the decode reported an error in the stream")
        if choice is None:
            if type(obj.get("usage")) is dict:
                self.usage_sent = True
            return [*self._flush(), *_whole(self._output(original, event, obj, None, None))]
        ids = choice.get("token_ids")
        finish = choice.get("finish_reason")
        if self.chat:
            delta = choice.get("delta")
            delta = delta if type(delta) is dict else {}
            if delta.get("tool_calls"):
                self._stop("a tool call had started")
            elif delta.get("reasoning") or delta.get("reasoning_content"):
                self._stop("reasoning had started")
            visible = bool(delta.get("content"))
        else:
            delta = None
            visible = bool(choice.get("text"))
        if self.want_prompt_ids and self.prompt_ids is None:
            prompt = (obj if self.chat else choice).get("prompt_token_ids")
            if type(prompt) is list and prompt:
                self.prompt_ids = prompt
        if type(ids) is not list:
            if visible:
                self._stop("the decode sent text without its token ids")
            ids = None
        out = self._output(original, event, obj, choice, delta)
        if not out:
            return []
        if self.stopped is None and ids and not visible and finish is None:
            self._held.append(out)
            self._held_ids.extend(ids)
            return []
        flushed = self._flush()
        if ids:
            self.ids.extend(ids)
        if finish is not None:
            index = choice.get("index", 0)
            self.finished[index if type(index) is int else 0] = str(finish)
        return [*flushed, out] if flushed else [out]

    def _output(
        self, original: bytes, event: bytes, obj: dict[str, Any], choice: dict[str, Any] | None, delta: Any
    ) -> bytes:
        """The event the caller gets; a ``ParsedEvent`` carrying ``obj`` where ``obj`` is its
        data, so the caller's steps (``handoff.CallerBody``) do not parse it again."""
        if self._splice is not None:
            spliced = self._splice.rewrite(obj, choice, delta)
            return ParsedEvent(spliced, obj) if spliced else spliced
        if self.keep_ids:
            return ParsedEvent(original, obj) if original is event else original
        out = event
        if choice is not None and "token_ids" in choice:
            out = _cut(out, _TOKEN_IDS)
        holder = obj if self.chat else choice
        if out and holder is not None and "prompt_token_ids" in holder:
            out = _cut(out, _PROMPT_TOKEN_IDS)
        if choice is not None:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        obj.pop("prompt_token_ids", None)
        if out:
            return ParsedEvent(out, obj)
        # Not the compact JSON vLLM writes: the event re-encoded without them.
        return ParsedEvent(b"data: " + orjson.dumps(obj) + b"\n\n", obj)


def _cut(event: bytes, key: bytes) -> bytes:
    """``event`` without the member ``key`` (``,"name":``) whose value is an id array or null; b"" if not found so."""
    at = event.find(key)
    if at < 0:
        return b""
    start = at + len(key)
    if event.startswith(b"[", start):
        end = event.find(b"]", start) + 1
        if end <= 0:
            return b""
    elif event.startswith(b"null", start):
        end = start + 4
    else:
        return b""
    return event[:at] + event[end:]


class _Splice:
    """Rewrites a continuation's events into the caller's stream."""

    __slots__ = ("base", "chat", "first", "header", "keep_ids", "prompt_tokens")

    def __init__(
        self, header: tuple[Any, Any, Any] | None, prompt_tokens: int, base: int, chat: bool, keep_ids: bool
    ) -> None:
        self.header = header
        self.prompt_tokens = prompt_tokens
        self.base = base
        """Generated tokens the caller had when this continuation began (in its prompt)."""
        self.chat = chat
        self.keep_ids = keep_ids
        self.first = True

    def rewrite(self, obj: dict[str, Any], choice: dict[str, Any] | None, delta: Any) -> bytes:
        if self.first and choice is not None:
            self.first = False
            if self.chat and delta and "role" in delta and not delta.get("content") and not choice.get("token_ids"):
                return b""  # the caller had its role chunk from the first server
        if self.header is not None:
            obj["id"], obj["created"], obj["model"] = self.header
        obj.pop("prompt_token_ids", None)
        if choice is not None:
            choice.pop("prompt_token_ids", None)
            if not self.keep_ids:
                choice.pop("token_ids", None)
        usage = obj.get("usage")
        if type(usage) is dict:
            generated = usage.get("completion_tokens")
            usage["prompt_tokens"] = self.prompt_tokens
            if isinstance(generated, int):
                usage["completion_tokens"] = self.base + generated
                usage["total_tokens"] = self.prompt_tokens + self.base + generated
            usage.pop("prompt_tokens_details", None)  # the continuation's prompt, not the caller's
        return b"data: " + orjson.dumps(obj) + b"\n\n"


# -- a non-streamed call's body ------------------------------------------------------------


class CannotAssemble(Exception):
    """The decode's events do not make the answer a non-streamed call expects; the message says why."""


class _Choice:
    """One choice of the answer, as its events arrive."""

    __slots__ = (
        "content",
        "finish_reason",
        "logprobs",
        "prompt_token_ids",
        "reasoning",
        "reasoning_key",
        "role",
        "stop_reason",
        "text_logprobs",
        "token_ids",
        "tool_calls",
    )

    def __init__(self) -> None:
        self.role: Any = None
        self.content: list[str] = []
        """Chat: the content deltas; completions: the text deltas."""
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning"
        self.tool_calls: dict[Any, dict[str, Any]] = {}
        self.logprobs: list[Any] | None = None
        """Chat: the entries of ``logprobs.content``, once a chunk carried them."""
        self.text_logprobs: dict[str, list[Any]] | None = None
        """Completions: ``logprobs``' four lists, once a chunk carried them."""
        self.finish_reason: Any = None
        self.stop_reason: Any = None
        self.token_ids: list[Any] = []
        self.prompt_token_ids: Any = None

    def add_chat(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if type(delta) is dict:
            if delta.get("role") is not None:
                self.role = delta["role"]
            if content := delta.get("content"):
                self.content.append(content)
            for key in ("reasoning", "reasoning_content"):
                if reasoning := delta.get(key):
                    self.reasoning.append(reasoning)
                    self.reasoning_key = key
            for call in delta.get("tool_calls") or ():
                self._tool_call(call)
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs.get("content") or ())
        self._add(choice)

    def add_text(self, choice: dict[str, Any]) -> None:
        if text := choice.get("text"):
            self.content.append(text)
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict:
            if self.text_logprobs is None:
                self.text_logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            for name, entries in self.text_logprobs.items():
                entries.extend(logprobs.get(name) or ())
        if choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = choice["prompt_token_ids"]
        self._add(choice)

    def _add(self, choice: dict[str, Any]) -> None:
        if type(ids := choice.get("token_ids")) is list:
            self.token_ids.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _tool_call(self, call: Any) -> None:
        """A tool call's deltas, merged as the openai SDK merges a streamed one: by index,
        the name and id once, the arguments concatenated."""
        if type(call) is not dict:
            return
        merged = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)), {"function": {}})
        for key in ("id", "type"):
            if call.get(key) is not None:
                merged[key] = call[key]
        function = call.get("function")
        if type(function) is dict:
            if function.get("name") is not None:
                merged["function"]["name"] = function["name"]
            if function.get("arguments"):
                merged["function"]["arguments"] = merged["function"].get("arguments", "") + function["arguments"]

    def message(self) -> dict[str, Any]:
        reasoning = "".join(self.reasoning) or None
        tool_calls = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {"name": call["function"].get("name"), "arguments": call["function"].get("arguments", "")},
            }
            for call in self.tool_calls.values()
        ]
        content: str | None = "".join(self.content)
        if not content and (reasoning is not None or tool_calls):
            content = None  # as vLLM's parsers leave it when the answer is all reasoning or tool calls
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = reasoning
        if self.reasoning_key != "reasoning":
            message[self.reasoning_key] = reasoning  # the name older servers stream it under
        return message


class Assembler:
    """A non-streamed call's JSON body, made of the events its decode leg streamed.

    Fed the events the caller would have had (``Tracker``'s output: ids stripped unless the
    caller asked for them, a continuation spliced in), it builds the body vLLM answers a
    non-streamed call with, field for field as vLLM 0.32 writes it: each choice's whole
    ``message`` (role, content, reasoning, tool calls) or ``text``, its ``logprobs`` entries
    in order, ``finish_reason`` and ``stop_reason``, the usage event's ``usage``, and
    ``token_ids`` / ``prompt_token_ids`` only when the caller asked for them.
    """

    __slots__ = (
        "_choices",
        "_framer",
        "_header",
        "_metrics",
        "_prompt_ids",
        "_usage",
        "chat",
        "fingerprint",
        "keep_ids",
    )

    def __init__(self, *, chat: bool, keep_ids: bool) -> None:
        self.chat = chat
        self.keep_ids = keep_ids
        self.fingerprint: Any = None
        self._framer = SSEFramer()
        self._header: tuple[Any, Any, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._metrics: Any = None
        self._prompt_ids: Any = None

    def feed(self, data: bytes) -> None:
        """Whole SSE events (a partial one waits for its end); raises ``CannotAssemble``."""
        for event in self._framer.feed(data):
            self._event(event_data(event))

    def body(self, usage: dict[str, int] | None = None) -> bytes:
        """The JSON body; ``usage`` stands in when no usage event came (a stream cut after its end)."""
        if rest := self._framer.rest().strip():
            self._event(event_data(rest))
        if self._header is None:
            raise CannotAssemble("the decode's stream ended before its first event")
        if not self._choices:
            raise CannotAssemble("the decode's stream carried no choice")
        event_id, created, model = self._header
        final = dict(self._usage if self._usage is not None else usage or {}) or None
        if final is not None:
            # The usage event leaves out what is None; a non-streamed body writes every field.
            final.setdefault("prompt_tokens_details", None)
            final.setdefault("completion_tokens_details", None)
        choices = [self._choice_body(index, c) for index, c in sorted(self._choices.items())]
        ids = self._prompt_ids if self.keep_ids else None
        answer: dict[str, Any] = {"id": event_id, "object": "chat.completion" if self.chat else "text_completion"}
        answer.update(created=created, model=model, choices=choices, service_tier=None)
        answer.update(system_fingerprint=self.fingerprint, usage=final)
        if self.chat:
            answer.update(prompt_logprobs=None, prompt_token_ids=ids, prompt_text=None)
        answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=self._metrics)
        return orjson.dumps(answer)

    def _choice_body(self, index: int, choice: _Choice) -> dict[str, Any]:
        token_ids = choice.token_ids if self.keep_ids else None
        if self.chat:
            logprobs = None if choice.logprobs is None else {"content": choice.logprobs}
            return {
                "index": index,
                "message": choice.message(),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "token_ids": token_ids,
                "routed_experts": None,
            }
        return {
            "index": index,
            "text": "".join(choice.content),
            "logprobs": choice.text_logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": token_ids,
            "prompt_logprobs": None,
            "prompt_token_ids": choice.prompt_token_ids if self.keep_ids else None,
            "routed_experts": None,
        }

    def _event(self, payload: bytes | None) -> None:
        if payload is None or is_done(payload):
            return  # a comment (a keep-alive), a field vLLM does not send, the stream's end
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise CannotAssemble("the decode sent an event that is not JSON") from None
        if type(obj) is not dict:
            raise CannotAssemble("the decode sent an event that is not a JSON object")
        if "error" in obj:
            error = obj["error"]
            message = error.get("message") if type(error) is dict else error
            raise CannotAssemble(f"the decode reported an error in its stream: {message}")
        if self._header is None:
            self._header = (obj.get("id"), obj.get("created"), obj.get("model"))
        if obj.get("system_fingerprint") is not None:
            self.fingerprint = obj["system_fingerprint"]
        if type(usage := obj.get("usage")) is dict:
            self._usage = usage
            self._metrics = obj.get("metrics", self._metrics)
        if self.chat and obj.get("prompt_token_ids") is not None:
            self._prompt_ids = obj["prompt_token_ids"]
        choices = obj.get("choices")
        if type(choices) is not list:
            return
        for choice in choices:
            if type(choice) is not dict:
                continue
            index = choice.get("index", 0)
            state = self._choices.get(index) if type(index) is int else None
            if state is None:
                if type(index) is not int:
                    raise CannotAssemble(f"the decode sent a choice whose index is {index!r}")
                state = self._choices[index] = _Choice()
            if self.chat:
                state.add_chat(choice)
            else:
                state.add_text(choice)
