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
  is re-rendered by the template in its own format, and its blocks are not counted.

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

A history the memory did not see answered (another replica's turns, or the caller's own
invention) is taken as cached on the call's word only up to ``unseen_history_tokens``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import math
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .._errors import PDConfigError
from ..wire import REMOTE_PREFILL_MODES, has_media

# Request fields besides the messages that change the rendered prompt (or may, depending on
# the server's flags): a call whose value differs from the previous turn's starts afresh.
_SHAPE_FIELDS = (
    "model",
    "tools",
    "functions",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
)
# Keys of an assistant message that may carry the streamed answer; any other key with a
# value may be rendered by the template, and the message is then not taken as the answer.
SHAPE_FIELDS = _SHAPE_FIELDS
"""The request fields besides ``messages`` that ``ConversationMemory`` reads of a call."""
_ANSWER_KEYS = frozenset({"role", "content", "tool_calls"})
_TEMPLATE_FIELDS = frozenset(
    {"role", "content", "tool_calls", "reasoning", "reasoning_content", "name", "tool_call_id", "task", "tools"}
)
"""The message fields vLLM hands the chat template (0.32: ``renderers/chat_utils.py``,
``_parse_chat_message_content``; ``reasoning_content`` before ``reasoning``); a message's
other fields are dropped unrendered."""
# A one-part content of these types is the same message as its text as a plain string
# (how an answer comes back and how the caller may send it again); a narrower question
# than whether a part is text at all (``wire.is_text_part``).
_STRING_EQUIVALENT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_DIGEST_SIZE = 16
_COLD_RATIO_MARGIN = 0.8
"""Until ``ratio_warmup`` server counts, a learned ratio is used times this (25 % more tokens):
the first counts may come from text unlike the next (another language, code), and one
count of the deployment's own tokenizer is still nearer than any fixed guess (SmolLM2 reads
the benchmark's words at ~6.5 chars per token, where ``initial_chars_per_token`` says 2)."""


@dataclass(frozen=True)
class ConversationSettings:
    """How conversations are remembered and when ``auto`` skips the remote prefill."""

    threshold_tokens: int = 256
    """``auto`` sends a call decode-only when its estimated uncached tokens are fewer than this..."""
    max_uncached_ratio: float = 0.7
    """...and they are less than this fraction of its prompt (Dynamo's default ratio)."""
    block_size: int = 128
    """The decode servers' KV block size. vLLM's CPU default; GPU servers default to 16.
    Too large only counts a few more tokens as uncached."""
    max_conversations: int = 10_000
    """LRU bound of the memory (under 400 bytes an entry)."""
    ratio_warmup: int = 8
    """Server counts to learn from before the learned chars-per-token ratio is used as it
    is; until then with a margin (25 % more tokens)."""
    initial_chars_per_token: float = 2.0
    """The ratio before the first server count: low, so tokens are over-estimated."""
    ratio_window: int = 64
    """A tenant's learned ratio is over its this many most recent samples."""
    overhead_tokens_per_message: int = 8
    """Template tokens per message (role markers, separators) added to every estimate."""
    unseen_history_tokens: int = 2048
    """Of a call's history that this memory did not see answered (turns another replica or
    worker answered, or turns made up), at most this many tokens count as cached on the
    call's word alone: the most such a call can put on a decode server's prefill if the
    history is not there (made up, or evicted). Enough for a conversation's first follow-up
    through another replica after a ~1,000-token first turn; 0 trusts none of it (a process
    then hands off the first follow-up it sees of a conversation another one answered)."""
    warm_prefill: bool = True
    """A decode-only call by ``auto`` also sends its prompt to the prefill server, off the
    caller's path, so a later P/D turn prefills only what is new (``fleet._warm``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.warm_prefill, bool):
            raise PDConfigError(f"conversations.warm_prefill must be a bool, got {self.warm_prefill!r}")
        for name in ("threshold_tokens", "ratio_warmup", "overhead_tokens_per_message", "unseen_history_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PDConfigError(f"conversations.{name} must be an int >= 0, got {value!r}")
        for name in ("block_size", "max_conversations", "ratio_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PDConfigError(f"conversations.{name} must be an int >= 1, got {value!r}")
        ratio = self.max_uncached_ratio
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0.0 < ratio <= 1.0:
            raise PDConfigError(f"conversations.max_uncached_ratio must be in (0, 1], got {ratio!r}")
        initial = self.initial_chars_per_token
        if not isinstance(initial, int | float) or isinstance(initial, bool) or not initial > 0:
            raise PDConfigError(f"conversations.initial_chars_per_token must be > 0, got {initial!r}")


class Match(str, enum.Enum):
    """How a call relates to the remembered conversation under its key."""

    EXTENDS_ANSWER = "extends_answer"
    """The previous messages, the streamed answer as the next message, then new ones."""
    EXTENDS_PROMPT = "extends_prompt"
    """The previous messages, then others (the answer edited, or not reusable: tool calls)."""
    UNKNOWN = "unknown"
    """Nothing remembered under this key."""
    EDITED = "edited"
    """The previous messages are not this call's first messages (edited, dropped, reordered)."""
    RESHAPED = "reshaped"
    """Tools, model or template options differ from the previous turn's."""
    ENDPOINT_UNAVAILABLE = "endpoint_unavailable"
    """The decode endpoint that holds the conversation is gone or not admitted."""
    EXTENDS_HISTORY = "extends_history"
    """Read from the call alone: its last assistant message ends what the conversation's
    decode endpoint computed (a turn this process did not see: another replica's or
    worker's, or one older than what it remembers)."""
    UNSEEN_HISTORY = "unseen_history"
    """As ``EXTENDS_HISTORY``, but more of the history than this memory saw answered would
    count as cached than ``ConversationSettings.unseen_history_tokens``: only that much does
    (a history made up by the caller, say a long document and an answer no server wrote)."""


@dataclass(frozen=True)
class Answer:
    """What the decode server streamed for a turn."""

    content: str | None
    tool_calls: Sequence[Mapping[str, Any]] = ()
    """Assembled from the stream: ``{"id", "type", "function": {"name", "arguments"}}``."""
    completion_tokens: int | None = None
    """From the final usage chunk, when the stream had one."""
    reasoning: bool = False
    """Whether the answer had reasoning content (templates drop or reformat it)."""


@dataclass(frozen=True)
class Estimate:
    """What a call would cost the decode endpoint that holds its conversation."""

    total_tokens: int
    uncached_tokens: int
    endpoint: str | None
    """The decode endpoint whose prefix cache holds the rest; None when nothing is cached."""
    match: Match
    adds_media: bool = False
    """The call's new messages carry a part other than text (an image, audio, video, a
    file, ...): its tokens are what the server's encoder makes of it, which nothing in the
    request tells (``uncached_tokens`` counts the part's JSON, a URL's ~35 tokens)."""

    @property
    def cached_tokens(self) -> int:
        return self.total_tokens - self.uncached_tokens


class Reason(str, enum.Enum):
    """Why ``decide_remote_prefill`` chose as it did (machine-readable, for traces and metrics)."""

    MODE_ALWAYS = "mode_always"
    MODE_NEVER = "mode_never"
    NO_ESTIMATE = "no_estimate"
    UNCACHED_AT_OR_ABOVE_THRESHOLD = "uncached_at_or_above_threshold"
    UNCACHED_RATIO_AT_OR_ABOVE = "uncached_ratio_at_or_above"
    ADDS_MEDIA = "adds_media"
    MOSTLY_CACHED = "mostly_cached"


@dataclass(frozen=True)
class Decision:
    remote_prefill: bool
    reason: Reason
    decode_endpoint: str | None
    """Where the decode leg should go when it is admitted: the endpoint holding the
    conversation. Also on the P/D path, where it pulls only the blocks it lacks."""
    estimate: Estimate | None = None


def decide_remote_prefill(mode: str, estimate: Estimate | None, settings: ConversationSettings) -> Decision:
    """Whether a call gets a remote prefill.

    ``always``: every call (pdclient's behaviour before conversations were remembered). ``never``: none, every
    call decode-only. ``auto``: decode-only when the uncached tokens are fewer than
    ``threshold_tokens`` and less than ``max_uncached_ratio`` of the prompt, as Dynamo's
    conditional disaggregation does (both conditions); llm-d's prefix-based decider and
    vllm-router's design use the absolute count alone. A call whose new messages add
    media (``Estimate.adds_media``) is a handoff whatever its count: an image is hundreds
    to thousands of tokens, and the vision encoder's work with them, that only the server
    can count, and a decode-only call would make the decode server do it all while its
    other streams stall.
    """
    endpoint = estimate.endpoint if estimate is not None else None
    if mode == "always":
        return Decision(True, Reason.MODE_ALWAYS, endpoint, estimate)
    if mode == "never":
        return Decision(False, Reason.MODE_NEVER, endpoint, estimate)
    if mode != "auto":
        raise ValueError(f"remote_prefill must be one of {REMOTE_PREFILL_MODES}, got {mode!r}")
    if estimate is None:
        return Decision(True, Reason.NO_ESTIMATE, None, None)
    if estimate.adds_media:
        return Decision(True, Reason.ADDS_MEDIA, endpoint, estimate)
    if estimate.uncached_tokens >= settings.threshold_tokens:
        return Decision(True, Reason.UNCACHED_AT_OR_ABOVE_THRESHOLD, endpoint, estimate)
    total = max(estimate.total_tokens, 1)
    if estimate.uncached_tokens / total >= settings.max_uncached_ratio:
        return Decision(True, Reason.UNCACHED_RATIO_AT_OR_ABOVE, endpoint, estimate)
    return Decision(False, Reason.MOSTLY_CACHED, endpoint, estimate)


# -- digests and text lengths ---------------------------------------------------------


def _encode(value: object) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)


def _messages_digest(messages: Sequence[object]) -> bytes:
    """One digest of a message list; equal lists (as JSON, keys sorted) give equal digests."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for message in messages:
        encoded = _encode(message)
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    return h.digest()


def _shape_digest(body: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(_encode([body.get(k) for k in _SHAPE_FIELDS]), digest_size=_DIGEST_SIZE).digest()


def _text_of(content: object) -> str | None:
    """A message content as the plain text it renders to, or None if it is not plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
        part = content[0]
        if part.get("type") in _STRING_EQUIVALENT_PART_TYPES and isinstance(part.get("text"), str):
            return str(part["text"])
    return None


def adds_media(messages: Sequence[object]) -> bool:
    """Whether any of ``messages`` has a content part other than text (``wire.is_text_part``):
    something the server encodes itself, an image, audio, video, a file. Unsure is media: a
    handoff costs little more than a decode-only call, while an image on the decode server
    costs its whole encoding there."""
    return has_media(list(messages))


def _answer_digest(content: str | None, tool_calls: Sequence[Mapping[str, Any]]) -> bytes:
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(orjson.JSONDecodeError):  # the server parses them before rendering
                arguments = orjson.loads(arguments)
        calls.append([call.get("id"), function.get("name"), arguments])
    return hashlib.blake2b(_encode([content, calls]), digest_size=_DIGEST_SIZE).digest()


def _as_answer_digest(message: object) -> bytes | None:
    """The digest of an assistant message that may be a streamed answer sent back, else None."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    if any(value is not None for key, value in message.items() if key not in _ANSWER_KEYS):
        return None
    content = message.get("content")
    text = None if content is None else _text_of(content)
    if content is not None and text is None:
        return None
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
        return None
    return _answer_digest(text, tool_calls)


def rendered_chars(messages: Sequence[object], tools: object = None) -> int:
    """The length of the text a chat template renders from these messages and tools,
    without the template's own markup (counted per message by the settings).

    Only what the server hands the template counts (``_TEMPLATE_FIELDS``; of a tool call
    its id, type, name and arguments; of a tool its type and function): any other field
    of a message is dropped before rendering, and counting it would read a padded call
    as text the template never renders.
    """
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            total += len(_encode(message))
            continue
        for key, value in message.items():
            if value is None or key not in _TEMPLATE_FIELDS:
                continue
            if key == "content":
                total += _content_chars(value)
            elif key == "tool_calls":
                total += len(_encode(_tool_calls_rendered(value)))
            elif isinstance(value, str):
                total += len(value)
            else:  # the template renders them as JSON or close to it
                total += len(_encode(value))
    if tools:
        total += len(_encode(_tools_rendered(tools)))
    return total


def _tool_calls_rendered(calls: object) -> object:
    if not isinstance(calls, list):
        return calls
    rendered: list[object] = []
    for call in calls:
        if not isinstance(call, dict):
            rendered.append(call)
            continue
        function = call.get("function")
        if isinstance(function, dict):
            function = {k: function[k] for k in ("name", "arguments") if k in function}
        rendered.append({k: function if k == "function" else call[k] for k in ("id", "type", "function") if k in call})
    return rendered


def _tools_rendered(tools: object) -> object:
    if not isinstance(tools, list):
        return tools
    return [
        {k: tool[k] for k in ("type", "function") if k in tool} if isinstance(tool, dict) else tool for tool in tools
    ]


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        chars = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                chars += len(part["text"])
            else:
                chars += len(_encode(part))
        return chars
    return len(_encode(content))


def _reusable_answer_text(message: object) -> str | None:
    """An assistant message's text when it may be the answer as generated (plain text, no
    tool calls, nothing else the template renders), whose ids the next prompt starts with."""
    if _as_answer_digest(message) is None:
        return None
    assert isinstance(message, dict)
    if message.get("tool_calls"):
        return None
    content = message.get("content")
    return None if content is None else _text_of(content)


def _is_assistant(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_SIZE).digest()


# -- the memory -----------------------------------------------------------------------


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


_NUMBERS = struct.Struct("<Iqqqqd?")
"""A turn's numbers: messages, prompt_tokens, cached_floor, answer_tokens, answer_chars
(-1: unknown), chars_per_token (NaN: unknown), prompt_pulled."""
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
        )
        self.packed = turn.digests + numbers
        self.endpoint = sys.intern(str(turn.endpoint))

    def turn(self) -> _Turn:
        digests, numbers = self.packed[: 3 * _DIGEST_SIZE], self.packed[3 * _DIGEST_SIZE :]
        messages, prompt_tokens, cached_floor, answer_tokens, answer_chars, ratio, pulled = _NUMBERS.unpack(numbers)
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
    ) -> None:
        """Record a turn the decode endpoint answered: the next turn's prefix.

        ``prompt_tokens``: the call's prompt length in ids (the prefill's
        ``prompt_token_ids``, or ``usage.prompt_tokens``); None when no server said, and
        then ``cached_floor`` is what is known to be cached (the estimate's cached tokens).
        ``prompt_pulled``: the turn was a P/D handoff (the decode server pulled the prompt's KV).
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
        answer_digest = _answer_digest(answer.content, answer.tool_calls)
        turn = _Turn(
            digests=_messages_digest(messages) + _shape_digest(body) + answer_digest,
            messages=len(messages),
            prompt_tokens=prompt_tokens,
            cached_floor=max(0, cached_floor),
            answer_tokens=answer.completion_tokens if reusable else None,
            answer_chars=rendered_chars([{"content": answer.content, "tool_calls": list(answer.tool_calls) or None}]),
            chars_per_token=own_ratio,
            endpoint=decode_endpoint,
            prompt_pulled=prompt_pulled,
        )
        key_digest, packed = _key_digest(key), _Packed(turn)
        with self._lock:
            self._turns[key_digest] = packed
            self._turns.move_to_end(key_digest)
            while len(self._turns) > self.settings.max_conversations:
                self._turns.popitem(last=False)

    def estimate(
        self,
        key: str,
        body: Mapping[str, Any],
        admitted: Collection[str],
        home: str | None = None,
        *,
        tenant: str | None = None,
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
        key_digest = _key_digest(key)
        with self._lock:
            packed = self._turns.get(key_digest)
            if packed is not None:
                self._turns.move_to_end(key_digest)
        if packed is None:
            if home is not None:
                return self._from_history(messages, tools, home, None, tenant=tenant)
            return self._fresh(messages, tools, Match.UNKNOWN, tenant)
        turn = packed.turn()
        prompt_digest, shape_digest, answer_digest = (
            turn.digests[:_DIGEST_SIZE],
            turn.digests[_DIGEST_SIZE : 2 * _DIGEST_SIZE],
            turn.digests[2 * _DIGEST_SIZE :],
        )
        if _shape_digest(body) != shape_digest:
            return self._fresh(messages, tools, Match.RESHAPED, tenant)
        if len(messages) < turn.messages or _messages_digest(messages[: turn.messages]) != prompt_digest:
            return self._fresh(messages, tools, Match.EDITED, tenant)
        if turn.endpoint not in admitted:
            return self._fresh(messages, tools, Match.ENDPOINT_UNAVAILABLE, tenant)
        answered = len(messages) > turn.messages and _as_answer_digest(messages[turn.messages]) == answer_digest
        if any(_is_assistant(m) for m in messages[turn.messages + 1 :]):
            # Turns since the remembered one were answered elsewhere in the fleet (another
            # replica, on the same endpoint): the call itself says more than the memory.
            # The remembered prompt's exact length still anchors the count: only what came
            # after it is estimated from its text.
            known = (turn.messages, turn.prompt_tokens) if turn.prompt_tokens is not None else None
            return self._from_history(messages, tools, turn.endpoint, turn.chars_per_token, known, tenant=tenant)
        return self._extension(turn, messages, answered, tenant)

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
        last = max((i for i, m in enumerate(messages) if _is_assistant(m)), default=None)
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
        answer = _reusable_answer_text(messages[last])
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


# -- the answer a caller received -----------------------------------------------------

_MAX_JSON_ANSWER = 8 * 1024 * 1024
"""A non-streamed answer body larger than this is not remembered (it is buffered whole)."""


class AnswerCollector:
    """The answer a caller received, from the decode body as it was handed on.

    Streamed (SSE): the stream's one framer hands each whole event's parsed data to
    ``event`` (``wire.event_json``), and only the answer is kept (its text, its tool
    calls, whether it had reasoning, the final usage). Non-streamed: the JSON body is
    ``feed``-ed, kept (up to 8 MB) and parsed at the end. ``answer()`` is None unless the
    answer is whole (a ``finish_reason`` seen) and has one choice.
    """

    def __init__(self, *, stream: bool) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._content: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._reasoning = False
        self._finished = False
        self._spoiled = False
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        """``usage.prompt_tokens`` as the decode server reported it, when it did."""
        self.cached_tokens: int | None = None
        """``usage.prompt_tokens_details.cached_tokens`` as the decode server reported it
        (its prefix-cache hits; servers run with ``--enable-prompt-tokens-details``)."""

    def feed(self, data: bytes) -> None:
        """Bytes of a non-streamed answer's JSON body."""
        if self._spoiled or not data:
            return
        self._buffer += data
        if len(self._buffer) > _MAX_JSON_ANSWER:
            self._spoil()

    def answer(self) -> Answer | None:
        """The whole answer, or None (cut, abandoned, several choices, not parsable)."""
        if not self._stream and not self._spoiled and not self._finished:
            self._parse_json(bytes(self._buffer))
            self._buffer = bytearray()
        if self._spoiled or not self._finished:
            return None
        calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        content = "".join(self._content) if self._content or not calls else None
        return Answer(content, tuple(calls), self.completion_tokens, self._reasoning)

    def _spoil(self) -> None:
        self._spoiled = True
        self._buffer = bytearray()
        self._content = []

    def event(self, chunk: object) -> None:
        """One streamed event's data, parsed (None: an event without data, or ``[DONE]``);
        anything but a JSON object spoils the answer."""
        if self._spoiled or chunk is None:
            return
        if not isinstance(chunk, dict):
            self._spoil()
            return
        self._usage(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self._spoil()  # n > 1: which one goes on is the caller's choice
                return
            self._delta(choice.get("delta"))
            if choice.get("finish_reason") is not None:
                self._finished = True

    def _delta(self, delta: object) -> None:
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if isinstance(content, str):
            self._content.append(content)
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self._reasoning = True
        for part in delta.get("tool_calls") or ():
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            call = self._tool_calls.setdefault(
                index if isinstance(index, int) else 0, {"id": None, "type": "function", "function": {}}
            )
            for name in ("id", "type"):
                if part.get(name) is not None:
                    call[name] = part[name]
            function = part.get("function")
            if isinstance(function, dict):
                for name in ("name", "arguments"):
                    piece = function.get(name)
                    if isinstance(piece, str):
                        call["function"][name] = call["function"].get(name, "") + piece

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        for name in ("completion_tokens", "prompt_tokens"):
            value = usage.get(name)
            if type(value) is int and value >= 0:
                setattr(self, name, value)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int and cached >= 0:
            self.cached_tokens = cached

    def _parse_json(self, body: bytes) -> None:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._spoil()
            return
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            self._spoil()
            return
        assert isinstance(payload, dict)
        self._usage(payload.get("usage"))
        message = choices[0].get("message")
        if not isinstance(message, dict):
            self._spoil()
            return
        content = message.get("content")
        if isinstance(content, str):
            self._content.append(content)
        if message.get("reasoning_content") or message.get("reasoning"):
            self._reasoning = True
        calls = message.get("tool_calls") or []
        if isinstance(calls, list):
            self._tool_calls = {i: c for i, c in enumerate(calls) if isinstance(c, dict)}
        self._finished = choices[0].get("finish_reason") is not None
