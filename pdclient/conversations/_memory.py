"""Conversations: what a decode server already holds of a call's prompt, and whether to skip the prefill.

Pure (no I/O, no clock) and thread-safe; the transport feeds it and asks it.

A chat call that continues a conversation resends the previous turn's messages, the answer
the decode server streamed, and a short new message. The decode server that answered the
previous turn holds that prefix in its prefix cache, so a decode-only call there computes
only the new tokens, where a second P/D handoff would prefill the answer and the new
message again on the prefill server (which never saw the answer) and move the KV.

What the decode server holds, measured on vLLM 0.32 (two CPU servers, NIXL, SmolLM2;
docs/conversations.md has the figures):

- whole blocks only: ``block_size`` tokens (128 on CPU, 16 by default on GPU);
- after a decode-only turn, the prompt and the answer's tokens but the last one (the
  sampled token whose KV was never computed): after a turn with a P-token prompt and an
  A-token answer, ``floor((P + A - 1) / block_size)`` blocks;
- after a P/D turn, the prompt's whole blocks (pulled over NIXL, then cached like its
  own), ``floor(P / block_size)``, and not always more: the block holding the prompt's
  tail and the answer's start was found uncached in 11 of 12 such turns measured (and
  the answer's later blocks with it), so they are counted as uncached;
- the chat template re-renders a plain-text answer to the very ids that were generated, so
  the next prompt starts with those ``P + A`` ids; an answer with tool calls or reasoning
  is re-rendered by the template in its own format, and its blocks are not counted. Not
  always to the last id: a model may generate a split its tokenizer would not make (a
  real-pair run: two ``\n`` where re-rendering gives one ``\n\n``, 62 ids into the
  answer), and the cache serves only up to it; counting on past it over-estimates by the
  answer's later blocks, which the KV events, where they are read, do not.

The prefill server holds only the previous prompt's blocks: through P/D the next turn
prefills the answer and the new message there.

The memory keeps, per conversation (the affinity key), digests instead of text, packed
with the turn's numbers in one bytes object: under 400 bytes an entry whatever the
conversation's length, the LRU's own bookkeeping included once it has churned (~340
measured), so the default 10,000 entries stay under 4 MB (tests/unit/test_conversations.py
measures it). Chat calls only.

Without a tokenizer, token counts of text the servers have not counted yet come from a
chars-per-token ratio learned from the servers' own counts (the text length of a call's
messages against a prefill's ``len(prompt_token_ids)`` or a decode-only call's
``usage.prompt_tokens``), used from the first count on with a margin (more tokens) until
it has seen ``ratio_warmup`` calls; a remembered conversation's new text is estimated
with its own last prompt's ratio (its language, its style). The ratio is one per tenant,
learned from that tenant's calls only, and bounded (``_Ratio``): no caller's calls move
another's estimates, and none moves its own far.

With ``pdclient.kv_events`` on, a turn also keeps the chain keys of its prompt's token ids
(8 bytes a 128-id block: 2 KB more for a 32k-token prompt), and an estimate asks the
endpoint's index how much of that known prefix it still holds (``HeldTokens``): a
conversation the decode server evicted, or lost to a reset or a restart, is uncached by its
own word (``Estimate.cache_source`` ``"kv_events"``), where the estimate alone would call it
cached. The decode leg asks for its output ids too (and a decode-only turn for its prompt's,
``return_token_ids``, stripped before the caller sees them): a plain-text answer's blocks
are then keyed with the prompt's (all its ids but the last, whose KV is never computed), so
the count is exact for them as well, P/D turn or not.

A history the memory did not see answered (another replica's turns, or the caller's own
invention) is taken as cached on the call's word only up to ``unseen_history_tokens``;
with KV events current for its endpoint, the call's prompt ids (``wants_prompt_ids``: the
transport asks a prefill server's /tokenize for them) say exactly how much of it the
decode holds (``with_prompt_ids``).
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..kv_events import chain_keys, unpack
from ._answer import Answer
from ._decision import Estimate, Match
from ._digests import (
    DIGEST_SIZE,
    adds_media,
    answer_digest,
    as_answer_digest,
    is_assistant,
    key_digest,
    messages_digest,
    rendered_chars,
    reusable_answer_text,
    shape_digest,
)
from ._settings import ConversationSettings

_COLD_RATIO_MARGIN = 0.8
"""Until ``ratio_warmup`` server counts, a learned ratio is used times this (25 % more tokens):
the first counts may come from text unlike the next (another language, code), and one
count of the deployment's own tokenizer is still nearer than any fixed guess (SmolLM2 reads
the benchmark's words at ~6.5 chars per token, where ``initial_chars_per_token`` says 2)."""


@dataclass(frozen=True)
class _Turn:
    """One conversation's last turn, as ``estimate`` reads it (kept packed: ``_Packed``)."""

    digests: bytes
    """Of the prompt's messages, of its shape (tools, model, template options) and of the
    streamed answer, 16 bytes each, in one object."""
    messages: int
    prompt_tokens: int | None
    """The last prompt's length in ids, when a server said so."""
    cached_floor: int
    """Tokens known to be cached when ``prompt_tokens`` is unknown (a lower bound)."""
    answer_tokens: int | None
    """The answer's ids that the next prompt reuses, when known and reusable."""
    answer_chars: int
    chars_per_token: float | None
    """This conversation's own ratio, from its last prompt's text and length."""
    endpoint: str
    prompt_pulled: bool
    """The decode endpoint pulled the prompt's KV from a prefill (a P/D turn): only the
    prompt's whole blocks count as cached, not the answer's."""
    prompt_keys: bytes = b""
    """The chain keys (``kv_events.chain_keys``, packed) of the prompt's known token ids."""
    answer_keyed: bool = False
    """``prompt_keys`` go on through the answer's ids but its last (whose KV is never
    computed): the decode's events then say exactly what it holds of the answer too."""


_NUMBERS = struct.Struct("<Iqqqqd??")
"""A turn's numbers: messages, prompt_tokens, cached_floor, answer_tokens, answer_chars
(-1: unknown), chars_per_token (NaN: unknown), prompt_pulled, answer_keyed."""
_MAX_COUNT = 2**63 - 1


def _count(value: int | None) -> int:
    return -1 if value is None or value < 0 else min(value, _MAX_COUNT)


def _known(value: int) -> int | None:
    return None if value < 0 else value


class _Packed:
    """A turn in two small objects whatever the conversation's length: its digests and
    numbers in one bytes object, and its decode endpoint's URL, interned so that every
    conversation on an endpoint shares one string (the Python objects a ``_Turn`` holds
    would cost more than the turn's data: an int or a float is an object of its own)."""

    __slots__ = ("endpoint", "packed")

    def __init__(self, turn: _Turn) -> None:
        numbers = _NUMBERS.pack(
            turn.messages,
            _count(turn.prompt_tokens),
            _count(turn.cached_floor),
            _count(turn.answer_tokens),
            _count(turn.answer_chars),
            math.nan if turn.chars_per_token is None else turn.chars_per_token,
            turn.prompt_pulled,
            turn.answer_keyed,
        )
        self.packed = turn.digests + numbers + turn.prompt_keys
        self.endpoint = sys.intern(str(turn.endpoint))

    def turn(self) -> _Turn:
        end = 3 * DIGEST_SIZE + _NUMBERS.size
        digests, numbers, keys = self.packed[: 3 * DIGEST_SIZE], self.packed[3 * DIGEST_SIZE : end], self.packed[end:]
        messages, prompt_tokens, cached_floor, answer_tokens, answer_chars, ratio, pulled, keyed = _NUMBERS.unpack(
            numbers
        )
        return _Turn(
            digests=digests,
            messages=messages,
            prompt_tokens=_known(prompt_tokens),
            cached_floor=max(0, cached_floor),
            answer_tokens=_known(answer_tokens),
            answer_chars=max(0, answer_chars),
            chars_per_token=None if math.isnan(ratio) else ratio,
            endpoint=self.endpoint,
            prompt_pulled=pulled,
            prompt_keys=keys,
            answer_keyed=keyed,
        )


_MIN_CHARS_PER_TOKEN = 0.5
_MAX_CHARS_PER_TOKEN = 8.0
"""The range of a learned ratio, what real tokenizers give on what a template renders.
Long English prose reads at 4-6.5 chars per token (6.5: SmolLM2 on the benchmark's
words), code at ~3, CJK text at 1-1.5, and scripts a tokenizer splits into bytes, or short
prompts that are mostly markup, below 1. Above the range lies only text the server never
counted (a field no template renders), which would read every later call as almost no
tokens: decode-only, with the whole prefill on the decode server. The floor is lower than
any text should go, since a low ratio only over-estimates tokens (a handoff)."""
_MAX_RATIO_STEP = 1.25
"""One server count moves a learned ratio by at most this factor (either way): one odd
call (a prompt mostly of a field the estimate counts and the template drops, a huge
document in another script) shifts the estimates a quarter, not eight-fold; steady traffic
of a new kind still gets there in a few calls (4 to 1.3 chars per token in five)."""
_MAX_TENANT_RATIOS = 1024
"""Tenants whose ratios are kept (LRU): ~1.3 KB each. A tenant forgotten starts again
from ``initial_chars_per_token``, which over-estimates tokens: its calls hand off more."""


class _Ratio:
    """One tenant's learned chars per token: its last ``window`` server counts, weighted by
    tokens, each kept within the range and moving the ratio by a bounded step."""

    __slots__ = ("chars", "next", "seen", "tokens")

    def __init__(self, window: int) -> None:
        self.chars = array("d", bytes(8 * window))
        self.tokens = array("d", bytes(8 * window))
        self.next = 0
        self.seen = 0

    def learned(self) -> float | None:
        tokens = sum(self.tokens)
        return sum(self.chars) / tokens if tokens > 0 else None

    def add(self, chars: int, tokens: int) -> None:
        kept = min(max(float(chars), _MIN_CHARS_PER_TOKEN * tokens), _MAX_CHARS_PER_TOKEN * tokens)
        before = self.learned()
        if before is not None:
            # The chars that would move the window's ratio (this sample in, the oldest
            # out) to the step's bounds, then the range again (a sample of its own text).
            others_chars = sum(self.chars) - self.chars[self.next]
            others_tokens = sum(self.tokens) - self.tokens[self.next] + tokens
            low = before / _MAX_RATIO_STEP * others_tokens - others_chars
            high = before * _MAX_RATIO_STEP * others_tokens - others_chars
            kept = min(max(kept, low), high)
            kept = min(max(kept, _MIN_CHARS_PER_TOKEN * tokens), _MAX_CHARS_PER_TOKEN * tokens)
        self.chars[self.next], self.tokens[self.next] = kept, float(tokens)
        self.next = (self.next + 1) % len(self.chars)
        self.seen += 1


HeldTokens = Callable[[str, Sequence[int], int], "int | None"]
"""How many leading tokens of a chain of keys (in blocks of the given size) an endpoint
holds, by its KV events; None when they do not say (``kv_events.KVEventFeeds.held_tokens``)."""


class ConversationMemory:
    """A bounded LRU memory of conversations and learned chars-per-token ratios (one per tenant).

    ``learn`` after each prefill response, ``remember`` after each answered turn,
    ``estimate`` before each call. All methods may be called from any thread.
    """

    def __init__(self, settings: ConversationSettings | None = None) -> None:
        self.settings = settings or ConversationSettings()
        self._turns: OrderedDict[bytes, _Packed] = OrderedDict()
        self._ratios: OrderedDict[str | None, _Ratio] = OrderedDict()
        """Per tenant (None: a client in process), so no tenant's calls move another's estimates."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)

    # -- chars per token ----------------------------------------------------------------

    def learn(self, body: Mapping[str, Any], prompt_tokens: int, *, tenant: str | None = None) -> None:
        """One sample of ``tenant``'s ratio: a chat call's messages and tools against its
        ``len(prompt_token_ids)``. A call with media teaches nothing: its ids are mostly
        what the server's encoder made of the media, which its JSON's length does not tell."""
        messages = body.get("messages")
        if not isinstance(messages, list) or prompt_tokens < 1 or adds_media(messages):
            return
        chars = rendered_chars(messages, body.get("tools"))
        if chars < 1:
            return
        with self._lock:
            ratio = self._ratios.get(tenant)
            if ratio is None:
                ratio = self._ratios[tenant] = _Ratio(self.settings.ratio_window)
                while len(self._ratios) > _MAX_TENANT_RATIOS:
                    self._ratios.popitem(last=False)
            self._ratios.move_to_end(tenant)
            ratio.add(chars, prompt_tokens)

    @property
    def chars_per_token(self) -> float:
        """The ratio estimates use for calls without a tenant (a client in process)."""
        return self.tenant_chars_per_token(None)

    def tenant_chars_per_token(self, tenant: str | None) -> float:
        """The ratio estimates use for ``tenant``'s calls."""
        with self._lock:
            return self._chars_per_token(tenant)[0]

    def _chars_per_token(self, tenant: str | None) -> tuple[float, bool]:
        """``tenant``'s chars over tokens of its recent samples, with the cold margin until
        warm, and whether it is warm; the initial ratio before its first sample.

        The samples' tokens include the template's markup, which lowers the ratio: more
        tokens estimated, on top of the per-message overhead the estimates add. Weighted
        by tokens, so a short prompt, mostly markup, moves it little.
        """
        ratio = self._ratios.get(tenant)
        learned = ratio.learned() if ratio is not None else None
        if ratio is None or learned is None:
            return self.settings.initial_chars_per_token, False
        self._ratios.move_to_end(tenant)
        warm = ratio.seen >= self.settings.ratio_warmup
        return (learned if warm else learned * _COLD_RATIO_MARGIN), warm

    def tokens_for(
        self, chars: int, messages: int, own_ratio: float | None = None, *, tenant: str | None = None
    ) -> int:
        """Estimated tokens of ``chars`` characters of text in ``messages`` messages of ``tenant``'s.

        ``own_ratio``: the conversation's own chars per token, measured on its last
        prompt (its language and style), used instead of the learned one, and capped
        by it until warm.
        """
        with self._lock:
            ratio, warm = self._chars_per_token(tenant)
        if own_ratio is not None:
            ratio = own_ratio if warm else min(own_ratio, ratio)
        return math.ceil(chars / ratio) + messages * self.settings.overhead_tokens_per_message

    # -- conversations ------------------------------------------------------------------

    def remember(
        self,
        key: str,
        body: Mapping[str, Any],
        answer: Answer,
        decode_endpoint: str,
        *,
        prompt_tokens: int | None,
        cached_floor: int = 0,
        prompt_pulled: bool = False,
        prompt_keys: bytes = b"",
        answer_keyed: bool = False,
    ) -> None:
        """Record a turn the decode endpoint answered: the next turn's prefix.

        ``prompt_tokens``: the call's prompt length in ids (the prefill's
        ``prompt_token_ids``, or ``usage.prompt_tokens``); None when no server said, and
        then ``cached_floor`` is what is known to be cached (the estimate's cached tokens).
        ``prompt_pulled``: the turn was a P/D handoff (the decode server pulled the prompt's KV).
        ``prompt_keys``: the packed chain keys of the prompt's ids, in ``block_size`` blocks;
        ``answer_keyed``: of the prompt's and the answer's ids but its last (a plain-text
        answer, which the next prompt re-renders to the same ids).
        """
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        reusable = answer.content is not None and not answer.tool_calls and not answer.reasoning
        chars = rendered_chars(messages, body.get("tools"))
        own_ratio = (
            min(max(chars / prompt_tokens, _MIN_CHARS_PER_TOKEN), _MAX_CHARS_PER_TOKEN)
            if prompt_tokens and chars > 0
            else None
        )
        answer_hash = answer_digest(answer.content, answer.tool_calls)
        turn = _Turn(
            digests=messages_digest(messages) + shape_digest(body) + answer_hash,
            messages=len(messages),
            prompt_tokens=prompt_tokens,
            cached_floor=max(0, cached_floor),
            answer_tokens=answer.completion_tokens if reusable else None,
            answer_chars=rendered_chars([{"content": answer.content, "tool_calls": list(answer.tool_calls) or None}]),
            chars_per_token=own_ratio,
            endpoint=decode_endpoint,
            prompt_pulled=prompt_pulled,
            prompt_keys=prompt_keys,
            answer_keyed=answer_keyed and reusable and bool(prompt_keys),
        )
        entry = key_digest(key)
        if not prompt_keys:
            turn = replace(
                turn, prompt_keys=self._known_prefix(entry, messages, turn.digests[DIGEST_SIZE : 2 * DIGEST_SIZE])
            )
        packed = _Packed(turn)
        with self._lock:
            self._turns[entry] = packed
            self._turns.move_to_end(entry)
            while len(self._turns) > self.settings.max_conversations:
                self._turns.popitem(last=False)

    def known_keys(self, key: str, body: Mapping[str, Any]) -> list[int]:
        """The chain keys of the remembered turn's ids that this call's prompt starts with
        (``kv_events``: a prefix cache's holdings can be asked about them); none when the
        call does not extend the remembered turn, or its ids were not kept."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        return unpack(self._known_prefix(key_digest(key), messages, shape_digest(body)))

    def _known_prefix(self, entry: bytes, messages: Sequence[object], shape: bytes) -> bytes:
        """The chain keys of the remembered turn this call extends in the same ``shape``
        (its prompt is this call's prefix: a decode-only turn knows no ids of its own);
        none otherwise."""
        with self._lock:
            packed = self._turns.get(entry)
        if packed is None:
            return b""
        previous = packed.turn()
        if not previous.prompt_keys or len(messages) < previous.messages:
            return b""
        if previous.digests[DIGEST_SIZE : 2 * DIGEST_SIZE] != shape:
            return b""
        if messages_digest(messages[: previous.messages]) != previous.digests[:DIGEST_SIZE]:
            return b""
        return previous.prompt_keys

    def estimate(
        self,
        key: str,
        body: Mapping[str, Any],
        admitted: Collection[str],
        home: str | None = None,
        *,
        tenant: str | None = None,
        held: HeldTokens | None = None,
    ) -> Estimate:
        """The call's estimated total and uncached tokens on the decode endpoint holding it.

        A call that extends the remembered conversation (its messages, then the streamed
        answer, then new messages) has as uncached tokens the new messages, the template's
        markup and the partial last block. ``home``: the decode endpoint every process
        routes this conversation to (``routing.Rendezvous``), None when that is unknown or
        was passed over for its load. A call this memory knows nothing of, or that goes on
        past the remembered turn's answer, is read from its own messages on that endpoint
        (``Match.EXTENDS_HISTORY``); anything else is wholly uncached. Text no server
        counted is read with ``tenant``'s learned ratio (``learn``).
        """
        messages = body.get("messages")
        if not isinstance(messages, list):
            messages = []
        tools = body.get("tools")
        entry = key_digest(key)
        with self._lock:
            packed = self._turns.get(entry)
            if packed is not None:
                self._turns.move_to_end(entry)
        if packed is None:
            if home is not None:
                return self._from_history(messages, tools, home, None, tenant=tenant)
            return self._fresh(messages, tools, Match.UNKNOWN, tenant)
        turn = packed.turn()
        prompt_held, shape_held, answer_held = (
            turn.digests[:DIGEST_SIZE],
            turn.digests[DIGEST_SIZE : 2 * DIGEST_SIZE],
            turn.digests[2 * DIGEST_SIZE :],
        )
        if shape_digest(body) != shape_held:
            return self._fresh(messages, tools, Match.RESHAPED, tenant)
        if len(messages) < turn.messages or messages_digest(messages[: turn.messages]) != prompt_held:
            return self._fresh(messages, tools, Match.EDITED, tenant)
        answered_at = turn.endpoint
        if held is not None and turn.prompt_keys:
            turn = replace(turn, endpoint=self._best_holder(turn, admitted, home, held))
        if turn.endpoint not in admitted:
            return self._fresh(messages, tools, Match.ENDPOINT_UNAVAILABLE, tenant)
        answered = len(messages) > turn.messages and as_answer_digest(messages[turn.messages]) == answer_held
        if any(is_assistant(m) for m in messages[turn.messages + 1 :]):
            # Turns since the remembered one were answered elsewhere in the fleet (another
            # replica, on the same endpoint): the call itself says more than the memory.
            # The remembered prompt's exact length still anchors the count: only what came
            # after it is estimated from its text.
            known = (turn.messages, turn.prompt_tokens) if turn.prompt_tokens is not None else None
            return self._from_history(messages, tools, turn.endpoint, turn.chars_per_token, known, tenant=tenant)
        estimate = self._extension(turn, messages, answered, tenant)
        return self._with_events(estimate, turn, held, moved=turn.endpoint != answered_at, answered=answered)

    def _best_holder(self, turn: _Turn, admitted: Collection[str], home: str | None, held: HeldTokens) -> str:
        """The admitted decode endpoint whose events say it holds most of the turn's known
        prefix; ties go to the endpoint that answered the turn, then to ``home``. The
        turn's own endpoint when no events say anything of any."""
        keys = unpack(turn.prompt_keys)
        block = self.settings.block_size
        counts = {endpoint: held(endpoint, keys, block) for endpoint in admitted}
        known = {endpoint: tokens for endpoint, tokens in counts.items() if tokens is not None}
        if not known or max(known.values()) == 0:
            return turn.endpoint
        most = max(known.values())
        for preferred in (turn.endpoint, home):
            if preferred is not None and known.get(preferred) == most:
                return preferred
        return min(endpoint for endpoint, tokens in known.items() if tokens == most)

    def _with_events(
        self, estimate: Estimate, turn: _Turn, held: HeldTokens | None, *, moved: bool, answered: bool
    ) -> Estimate:
        """The estimate corrected by what the endpoint's events say it holds of the turn's
        known prefix: the exact cached count when the keys name the answer's blocks too
        (``answer_keyed``; only the prompt's whole blocks when the call left the answer out:
        ``answered`` False) or when less than all of it is held; else all of it confirms the
        estimate (whose answer blocks no event can name without the answer's ids), unless
        the call ``moved`` to an endpoint other than the one that computed the answer."""
        if held is None or not turn.prompt_keys:
            return estimate
        keys = unpack(turn.prompt_keys)
        block = self.settings.block_size
        tokens = held(turn.endpoint, keys, block)
        if tokens is None:
            return estimate
        cached = estimate.cached_tokens
        if turn.answer_keyed and not answered and turn.prompt_tokens is not None:
            tokens = min(tokens, turn.prompt_tokens)
        if turn.answer_keyed or moved or tokens < len(keys) * block:
            cached = (min(tokens, estimate.total_tokens - 1) // block) * block
        total = estimate.total_tokens
        return Estimate(total, total - cached, estimate.endpoint, estimate.match, estimate.adds_media, "kv_events")

    def wants_prompt_ids(self, estimate: Estimate, held: HeldTokens | None) -> bool:
        """Whether the call's prompt ids are worth asking a server for, to count what the
        decode endpoint holds of a history this memory never saw answered (another
        process's turns, or a made-up few-shot history): the estimate read it from the call
        alone (``EXTENDS_HISTORY``, ``UNSEEN_HISTORY``), that endpoint's events are current,
        and the prompt is long enough (two blocks) for a block of its history to be held."""
        if held is None or estimate.endpoint is None:
            return False
        if estimate.match not in (Match.EXTENDS_HISTORY, Match.UNSEEN_HISTORY):
            return False
        block = self.settings.block_size
        if estimate.total_tokens < 2 * block:
            return False
        return held(estimate.endpoint, (), block) is not None

    def with_prompt_ids(self, estimate: Estimate, token_ids: Sequence[int], held: HeldTokens) -> Estimate:
        """The estimate of a call whose prompt ids are known (``wants_prompt_ids``): its length
        exact, and cached as far as its endpoint's events hold its leading blocks; the
        estimate as it was when those events no longer say."""
        if estimate.endpoint is None or not token_ids:
            return estimate
        block = self.settings.block_size
        tokens = held(estimate.endpoint, chain_keys(token_ids, block), block)
        if tokens is None:
            return estimate
        total = len(token_ids)
        cached = (min(tokens, total - 1) // block) * block
        return Estimate(total, total - cached, estimate.endpoint, estimate.match, estimate.adds_media, "kv_events")

    def _from_history(
        self,
        messages: Sequence[object],
        tools: object,
        endpoint: str,
        ratio: float | None,
        known: tuple[int, int] | None = None,
        *,
        tenant: str | None,
    ) -> Estimate:
        """What the conversation's decode endpoint holds, read from the call alone.

        Its last assistant message ends the previous turn there: the endpoint computed that
        turn's prompt (the messages before it) and, but for its last id, its answer, and
        holds them in whole blocks. A plain-text answer counts as cached up to its last
        whole block, as after a decode-only turn; an answer with tool calls or other fields
        is re-rendered in the template's own format and counts as uncached. ``known``: the
        call's first messages and their prompt's length in ids as a server counted it (a
        turn this memory saw), so that only the rest is estimated from its text.

        Of what this memory did not see answered, at most ``unseen_history_tokens`` count
        as cached (``Match.UNSEEN_HISTORY`` beyond): the call's history may be made up.

        What the call does not tell bounds the error. The prompt's length comes from its
        text, so where its last whole block ends is a guess: short by up to one block (as
        often long). After a P/D turn vLLM 0.32's decode server may not hit the block that
        holds the prompt's tail and the answer's start (``prompt_pulled``): the estimate is
        then short by the blocks the answer reaches into, none when it ends in the prompt's
        last block, at most one for an answer shorter than a block.
        """
        last = max((i for i, m in enumerate(messages) if is_assistant(m)), default=None)
        if last is None:
            return self._fresh(messages, tools, Match.UNKNOWN, tenant)
        start, head = known if known is not None else (0, 0)

        def tokens_to(end: int) -> int:
            # Each message's markup and the generation prompt after them; a known prompt's
            # generation prompt is the header of the answer that follows it.
            chars = rendered_chars(messages[start:end], None if known else tools)
            return head + self.tokens_for(chars, end - start + (0 if known else 1), ratio, tenant=tenant)

        total = tokens_to(len(messages))
        reused = tokens_to(last)
        answer = reusable_answer_text(messages[last])
        if answer is not None:
            # Its ids and the end-of-turn id, the last of which was never computed.
            reused += self.tokens_for(len(answer), 0, ratio, tenant=tenant)
        match = Match.EXTENDS_HISTORY
        # Nothing but the call says that history was ever answered there: a made-up one
        # reads alike, and its prefill would land on the decode server whole.
        trusted = head + self.settings.unseen_history_tokens
        if reused > trusted:
            reused, match = trusted, Match.UNSEEN_HISTORY
        block = self.settings.block_size
        cached = (min(reused, total - 1) // block) * block
        return Estimate(total, total - cached, endpoint, match, adds_media(messages[last:]))

    def _fresh(self, messages: Sequence[object], tools: object, match: Match, tenant: str | None) -> Estimate:
        # +1: the generation prompt that ends every prompt.
        total = self.tokens_for(rendered_chars(messages, tools), len(messages) + 1, tenant=tenant)
        return Estimate(total_tokens=total, uncached_tokens=total, endpoint=None, match=match)

    def _extension(self, turn: _Turn, messages: Sequence[object], answered: bool, tenant: str | None) -> Estimate:
        block = self.settings.block_size
        match = Match.EXTENDS_ANSWER if answered else Match.EXTENDS_PROMPT
        ratio = turn.chars_per_token
        new = messages[turn.messages + 1 :] if answered else messages[turn.messages :]
        media = adds_media(new)
        if turn.prompt_tokens is None:
            # The previous prompt's length is unknown: what is known to be cached, and the
            # whole call estimated from its text (an over-estimate) as the total.
            cached = (turn.cached_floor // block) * block
            total = max(self.tokens_for(rendered_chars(messages), len(messages) + 1, ratio, tenant=tenant), cached + 1)
            return Estimate(total, total - cached, turn.endpoint, match, media)
        # +1: the generation prompt that ends the call (the previous one is in its prompt).
        new_tokens = self.tokens_for(rendered_chars(new), len(new) + 1, ratio, tenant=tenant) if new else 0
        if answered and turn.answer_tokens is not None:
            # The template re-renders the answer to the ids that were generated; the last
            # one (the end-of-turn token, or the last before the length cap) was never
            # computed, so its KV is not cached. After a P/D turn only the prompt's blocks.
            reused = turn.prompt_tokens if turn.prompt_pulled else turn.prompt_tokens + turn.answer_tokens - 1
            total = turn.prompt_tokens + turn.answer_tokens + new_tokens
        else:
            reused = turn.prompt_tokens
            answer = self.tokens_for(turn.answer_chars, 1, ratio, tenant=tenant) if answered else 0
            total = turn.prompt_tokens + answer + new_tokens
        # Whole blocks only, and vLLM computes at least a prompt's last token itself.
        cached = (min(reused, total - 1) // block) * block
        return Estimate(total, total - cached, turn.endpoint, match, media)
