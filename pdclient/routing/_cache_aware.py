"""Cache-aware prefill routing: send a prompt where its prefix was sent before.

A vLLM server keeps the KV blocks of recent prompts (automatic prefix caching) and skips
recomputing a prompt's cached prefix. A router that remembers what it sent where can
aim for those hits, as SGLang's router and vllm-router do with an approximate radix
tree of each worker's request text. pdclient does the same per client process:

``PrefixIndex``: per endpoint, the chained hashes of fixed-size chunks of the prompt
text this process sent there (a chain hash names a whole prefix, as vLLM's block hashes
do), in LRU order. Inserting a prompt refreshes its chunks leaf first and root last, so
eviction takes leaves before the prefixes they extend: a shared system prompt that every
call touches is the last thing to go. Bounded per endpoint: at most ``max_chars`` of
text, i.e. ``max_chars // chunk_chars`` chunk entries. With the defaults (4 Mi chars,
about a million tokens: more than a large GPU's KV cache holds, so the index does not
forget what the server may still have; 128-char chunks) that is 32768 entries: ~4 MB per
endpoint when first filled, and under 10 MiB (~300 bytes an entry) once it keeps evicting,
since the table of a dict whose keys come and go grows to four times its entries
(measured: ``tests/unit/test_prefix_index.py``). That is all it keeps: hashes, never a
prompt's text, and the policy holds a call's hashes only while it routes it. Thread-safe
(one lock).

Tenants (``RouteRequest.tenant``, set by ``pdclient serve`` per caller): each tenant's
chain starts from a seed of its own, so the same text sent by two tenants hashes apart.
A call is matched only against its own tenant's prompts: no tenant's prompt decides where
another's call goes, and none can learn by its routing (or its time to first token) what
another sent. The tenants share each endpoint's bound, as they share the server's own
prefix cache: one tenant's traffic can push another's entries out, as it pushes their
blocks out of the server's cache, which only makes the other's calls route as new
prompts. Prompts without a tenant (a client in process) hash as before.

``CacheAware``: the policy. See its docstring for the rule and the defaults.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from .._errors import PDConfigError
from ..wire import is_text_part
from ._endpoint import EndpointView, Routed
from ._load_aware import LoadAware
from ._policy import RouteDecision, RouteRequest
from ._rendezvous import rendezvous

if TYPE_CHECKING:
    from ..wire import Plan

DEFAULT_CHUNK_CHARS = 128
DEFAULT_MAX_CHARS = 4 * 1024 * 1024


def prompt_text(body: Mapping[str, Any]) -> str | None:
    """The text a prefix cache sees of a chat or completions body: role-tagged messages in order.

    A prefix of the conversation renders to a prefix of this text, as it does with a
    chat template. Non-text parts (images, audio) stand in as a digest of their JSON,
    so two different images never look alike. None when there is nothing to render.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(f"<|{message.get('role', '')}|>")
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    if is_text_part(part) and isinstance(part, dict) and isinstance(part.get("text"), str):
                        parts.append(part["text"])
                    else:
                        digest = hashlib.blake2b(json.dumps(part, sort_keys=True, default=str).encode(), digest_size=8)
                        parts.append(f"<|part:{digest.hexdigest()}|>")
            if message.get("tool_calls"):
                parts.append(json.dumps(message["tool_calls"], sort_keys=True, default=str))
        return "".join(parts) or None
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) and prompt else None


def plan_text(plan: Plan) -> str | None:
    """``prompt_text`` of a planned call (its chat messages, or its completions prompt)."""
    if plan.messages is not None:
        return prompt_text({"messages": plan.messages})
    raw = plan.fields.get("prompt")
    if raw is None:
        return None
    try:
        return prompt_text({"prompt": orjson.loads(memoryview(raw))})
    except orjson.JSONDecodeError:
        return None


class PrefixIndex:
    """Per-key (endpoint URL) LRU sets of chained chunk hashes of the text sent there."""

    def __init__(self, *, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if chunk_chars < 1 or max_chars < chunk_chars:
            raise PDConfigError(f"PrefixIndex: need chunk_chars >= 1 and max_chars >= chunk_chars, got {chunk_chars}")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chars // chunk_chars
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._lock = threading.Lock()

    def hashes(self, text: str, tenant: str | None = None) -> list[int]:
        """The chain hashes of ``text``'s whole chunks as ``tenant`` sent it.

        A trailing partial chunk is left out, and so are chunks past the bound (an endpoint
        never holds a longer prefix). ``tenant``'s chain starts from its own seed: another
        tenant's hashes of the same text never match these.
        """
        size = self.chunk_chars
        chain = 0 if tenant is None else hash(("tenant", tenant))
        out = []
        for start in range(0, min(len(text) - size + 1, self.max_chunks * size), size):
            chain = hash((chain, text[start : start + size]))
            out.append(chain)
        return out

    def match(self, hashes: Sequence[int], keys: Iterable[str]) -> dict[str, int]:
        """How many characters of the prefix each key holds (whole chunks from the start)."""
        result = {}
        with self._lock:
            for key in keys:
                lru = self._lru.get(key)
                held = 0
                if lru is not None:
                    for h in hashes:
                        if h not in lru:
                            break
                        held += 1
                result[key] = held * self.chunk_chars
        return result

    def insert(self, hashes: Sequence[int], key: str) -> None:
        """Record that ``key`` was sent the text of ``hashes``; evict its least recently used chunks past the bound."""
        with self._lock:
            lru = self._lru.setdefault(key, OrderedDict())
            for h in reversed(hashes):  # leaf first, root last: the root ends up most recent
                lru[h] = None
                lru.move_to_end(h)
            while len(lru) > self.max_chunks:
                lru.popitem(last=False)

    def forget(self, key: str) -> None:
        """Drop everything known of ``key`` (an endpoint that left the pool)."""
        with self._lock:
            self._lru.pop(key, None)


class CacheAware:
    """Route a prompt to the endpoint holding its longest prefix, unless that would unbalance the pool.

    For each call (the same rule as SGLang's and vllm-router's ``cache_aware``):

    1. Imbalanced pool: if the most and least loaded candidates differ by more than
       ``balance_abs_threshold`` and the most is more than ``balance_rel_threshold``
       times the least, the least loaded, whatever the cache says.
    2. Otherwise the endpoint whose KV events (``RouteRequest.held_tokens``: the servers'
       own word, for a prompt whose leading ids are known) hold most of the prompt, if any
       holds some of it (ties: the less loaded); else the endpoint whose index holds the
       longest prefix of the prompt, if
       that prefix is at least ``threshold`` of the prompt (ties: the less loaded).
    3. Otherwise (a new prompt) the conversation's rendezvous choice on its affinity key,
       as the ``Affinity`` policy makes it (least loaded when the call has no key).

    A call is matched against its own tenant's prompts only (``RouteRequest.tenant``; see
    the module docstring).

    Every choice, whichever rule made it, is recorded in the index (``on_routed``); its
    ``RouteDecision`` names the rule (``events``, ``cache``, ``balance``, ``affinity``, ``least_loaded``)
    with ``match`` / ``prompt``: the characters of the prompt the chosen endpoint holds,
    and of the prompt (``low`` / ``high`` loads for ``balance``).

    With conversation affinity: rule 3 is ``Affinity``, so a new conversation lands where
    every other client process would put it, and its later turns match their own earlier
    prompts in rule 2 and stay. What rule 2 adds is reuse across conversations: one
    that opens with a long system prompt this process has sent before goes where that
    prompt is cached, where ``Affinity`` would hash it anywhere.

    Load: ``load`` (a ``LoadAware``) gives the servers' view when its samples are fresh,
    else this process's in-flight counts.

    Defaults, against SGLang's router and vllm-router (``--cache-threshold 0.3``,
    ``--balance-abs-threshold 64``, ``--balance-rel-threshold 1.5``, tree of at most
    2**26 characters per worker, LRU-leaf eviction every 120 s; vllm-router's library
    default ``CacheAwareConfig`` is 0.5 / 32 / 1.1, 10000 nodes every 30 s): the same
    threshold 0.3 and relative limit 1.5. The absolute limit is 8, not 64: a gateway
    counts every client's requests on a worker, one client process only its own (unless
    load signals are on), and at 64 one process would never see an imbalance at all.
    The index evicts on insert (no background sweep) within its size bound.
    """

    name = "cache_aware"
    legs = ("prefill",)
    """A prefill server's prefix cache is what it follows (the decode leg's KV comes from the prefill)."""
    wants_prompt_text = True

    def __init__(
        self,
        *,
        threshold: float = 0.3,
        balance_abs_threshold: float = 8,
        balance_rel_threshold: float = 1.5,
        index: PrefixIndex | None = None,
        load: LoadAware | None = None,
    ) -> None:
        if not 0 <= threshold <= 1 or balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise PDConfigError("CacheAware: need 0 <= threshold <= 1, balance_abs_threshold >= 0, rel >= 1")
        self.threshold = threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = index or PrefixIndex()
        self.load = load
        self._routing = threading.local()
        """The request this thread is routing and its hashes, from ``decide`` to ``on_routed``."""

    def _loads(self, endpoints: Sequence[Routed]) -> list[float]:
        if self.load is not None:
            return self.load.loads(endpoints)
        return [float(e.in_flight) for e in endpoints]

    def _hashes(self, request: RouteRequest, text: str) -> list[int]:
        # decide() and on_routed() get the same request one after the other, in one thread
        # (route_decision): hash its text once. Held by a weak reference to the request, so
        # no prompt outlives its call here.
        routing = getattr(self._routing, "request", None)
        if routing is not None and routing[0]() is request:
            hashes: list[int] = routing[1]
            return hashes
        hashes = self.index.hashes(text, request.tenant)
        self._routing.request = (weakref.ref(request), hashes)
        return hashes

    @property
    def wants_load_signals(self) -> bool:
        return self.load is not None

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        return self.decide(endpoints, request).endpoint

    def decide(self, endpoints: Sequence[Routed], request: RouteRequest) -> RouteDecision[Routed]:
        loads = self._loads(endpoints)
        low, high = min(loads), max(loads)
        least = endpoints[loads.index(low)]
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return RouteDecision(self.name, least, "balance", {"low": round(low, 2), "high": round(high, 2)})
        held_by = request.held_tokens
        if held_by:
            # The servers' own word (their KV events) on what they hold of the prompt's
            # known ids, over what this process remembers sending where.
            held_tokens = [held_by.get(e.url, 0) for e in endpoints]
            best = max(range(len(endpoints)), key=lambda i: (held_tokens[i], -loads[i]))
            if held_tokens[best] > 0:
                return RouteDecision(self.name, endpoints[best], "events", {"held": held_tokens[best]})
        text = request.prompt_text
        detail: dict[str, float] = {}
        if text:
            matched = self.index.match(self._hashes(request, text), [e.url for e in endpoints])
            best = max(range(len(endpoints)), key=lambda i: (matched[endpoints[i].url], -loads[i]))
            held = matched[endpoints[best].url]
            if held > 0 and held / len(text) >= self.threshold:
                return RouteDecision(self.name, endpoints[best], "cache", {"match": held, "prompt": len(text)})
            detail = {"match": held, "prompt": len(text)}  # the best match, below the threshold
        if request.affinity_key is not None:
            return RouteDecision(self.name, rendezvous(endpoints, request.affinity_key), "affinity", detail)
        return RouteDecision(self.name, least, "least_loaded", detail)

    def on_routed(self, endpoint: EndpointView, request: RouteRequest) -> None:
        if request.prompt_text:
            self.index.insert(self._hashes(request, request.prompt_text), endpoint.url)
        self._routing.request = None

    def on_removed(self, endpoint: EndpointView) -> None:
        """Discovery removed ``endpoint`` from the pool: forget what was sent there."""
        self.index.forget(endpoint.url)
