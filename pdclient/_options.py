"""What the user gave: ``PDOptions`` per client, ``CallOptions`` per call.

``PDOptions`` is frozen and validated when it is made: every bad argument is a
``PDConfigError`` naming it, at construction, never at the first call. The clients, the
transports, ``copy()`` and ``with_options()`` all take and derive from it
(``options.replace(...)``), as httpx's ``Limits`` / ``Timeout`` are passed around.

Per-call options travel in ``extra_body={"pdclient": {...}}``, are read and removed by
pdclient and never reach a server; a misspelt key is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import PDConfigError
from ._observe import PDObserver
from .conversations import ConversationSettings
from .fleet import DiscoverySettings, HealthSettings, ScrapeSettings
from .kv_events import check_setting, import_zmq
from .pools import DECODE_ENV, PREFILL_ENV, BreakerSettings, RetrySettings, URLArg, resolve_urls
from .routing import POLICIES, RoutingPolicy, legs_of, wants_load_signals
from .wire import (
    CALL_OPTIONS_KEY,
    SECRET_ENV,
    CallOptions,
    check_dispatch,
    check_failure_policy,
    check_migrations,
    check_remote_prefill,
)

if TYPE_CHECKING:
    from ._trace import PDTrace


DEFAULT_ROUTING = "least_outstanding"
"""``routing``'s default. Left at it (and no ``decode_routing``), chat conversations in
``remote_prefill`` ``auto`` / ``never`` are placed on decode endpoints by rendezvous on their
affinity key (``routing.Rendezvous``), the same in every process."""


def _check_routing(value: object, name: str = "routing") -> str | RoutingPolicy:
    if value is None:
        return "least_outstanding"
    if isinstance(value, str) and value in POLICIES:
        return value
    if not isinstance(value, str) and callable(getattr(value, "choose", None)):
        return value  # type: ignore[return-value]
    raise PDConfigError(f"{name} must be one of {sorted(POLICIES)} or a RoutingPolicy, got {value!r}")


def _check_settings(name: str, value: object, kind: type, *, keep_false: bool = False) -> Any:
    """A background feature's field: its settings, True for the defaults, False / None for off."""
    if value is True:
        return kind()
    if value is None or isinstance(value, kind):
        return value
    if value is False:
        return False if keep_false else None
    raise PDConfigError(f"{name} must be a {kind.__name__}, True (the defaults), False or None, got {value!r}")


def _check_fleet_options(options: PDOptions) -> None:
    """Per-leg routing and the background features (load signals, health checks, discovery)."""
    set_ = object.__setattr__
    for leg in ("prefill", "decode"):
        name = f"{leg}_routing"
        if getattr(options, name) is not None:
            set_(options, name, _check_routing(getattr(options, name), name))
        policy = options.policy_for(leg)
        if leg not in legs_of(policy):
            given = name if getattr(options, name) is not None else "routing"
            raise PDConfigError(
                f"{given}={policy!r} routes the {' and '.join(legs_of(policy))} leg only; pass it as "
                f"{legs_of(policy)[0]}_routing= and give the {leg} leg another policy (routing= or {name}=)"
            )
    set_(
        options, "load_signals", _check_settings("load_signals", options.load_signals, ScrapeSettings, keep_false=True)
    )
    if options.load_signals is False:
        for leg in ("prefill", "decode"):
            if wants_load_signals(options.policy_for(leg)):
                raise PDConfigError(
                    f"load_signals=False, but the {leg} leg's routing ({options.policy_for(leg)!r}) reads the "
                    "servers' /metrics; leave load_signals at None or choose another policy"
                )
    set_(options, "health_checks", _check_settings("health_checks", options.health_checks, HealthSettings))
    set_(options, "discovery", _check_settings("discovery", options.discovery, DiscoverySettings))


def _check_type(name: str, value: object, expected: type) -> None:
    if not isinstance(value, expected):
        raise PDConfigError(f"{name} must be a {expected.__name__}, got {type(value).__name__}: {value!r}")


@dataclass(frozen=True)
class PDOptions:
    """A P/D client's options, validated at construction (``PDConfigError`` names a bad one).

    URLs left out come from ``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``
    (comma-separated) and ``reuse_secret`` from ``$PDCLIENT_REUSE_SECRET``, read once,
    here. Derive a changed copy with ``options.replace(routing="affinity")``.
    """

    prefill_base_url: URLArg = None
    """A URL or a list of URLs (a pool)."""
    decode_base_url: URLArg = None
    on_prefill_failure: str = "decode"
    """``"decode"`` (send the call to decode without P/D), ``"fail"``, or a fallback base URL."""
    allow_call_fallback_url: bool = True
    """Whether a call's own ``on_prefill_failure`` (``extra_body={"pdclient": {...}}``) may
    name a fallback URL. A server that passes its callers' bodies on (``pdclient serve``)
    turns this off, else any caller could make it send requests to any address; such a
    call is then refused (400) before any server is called."""
    allow_call_overrides: bool = True
    """Whether a call's own options (``extra_body={"pdclient": {...}}``) may make it less
    conservative than these options: raise ``max_decode_migrations``, turn an
    ``on_prefill_failure`` of ``"fail"`` into ``"decode"``, or choose a ``remote_prefill``
    other than this one. Off, such an option is refused (400 naming it) and only
    narrowing ones pass: ``pdclient serve`` turns it off unless its operator allows them."""
    routing: str | RoutingPolicy = DEFAULT_ROUTING
    """Both legs' policy: ``"least_outstanding"``, ``"round_robin"``, ``"power_of_two"``,
    ``"affinity"``, ``"load_aware"`` (the servers' own queues from /metrics),
    ``"rendezvous"`` (the affinity key's endpoint by rendezvous hashing, with a load bound), or a
    ``RoutingPolicy``; ``prefill_routing`` / ``decode_routing`` override it per leg. Left at
    the default, a chat conversation's decode leg (``remote_prefill`` ``auto`` or ``never``)
    goes by ``"rendezvous"``, so every replica sends its turns to one decode endpoint."""
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    retries: RetrySettings = field(default_factory=RetrySettings)
    reuse_secret: str | None = field(default=None, repr=False)
    """Signs every leg for servers whose server patch guards ``kv_transfer_params``, and keys
    the decode endpoint's tag in Responses ids (``dialects._stored_state``): give every
    replica the same one."""
    on_trace: Callable[[PDTrace], None] | None = None
    """Called with each chat or completions call's ``PDTrace`` once the call is over."""
    observers: Sequence[PDObserver] = ()
    """Watch every call (see ``PDObserver``); e.g. ``pdclient.metrics.PrometheusObserver``."""
    prefill_routing: str | RoutingPolicy | None = None
    """The prefill leg's policy when not ``routing``; also ``"cache_aware"`` (prefill only:
    where the prompt's prefix was sent before)."""
    decode_routing: str | RoutingPolicy | None = None
    """The decode leg's policy when not ``routing``."""
    load_signals: ScrapeSettings | bool | None = None
    """Scrape every member's /metrics in the background (``ScrapeSettings``; True: the
    defaults). None: only the pools routed ``"load_aware"``; False: never."""
    health_checks: HealthSettings | bool | None = None
    """Probe every member's /health in the background, feeding its breaker
    (``HealthSettings``; True: the defaults). Off by default."""
    discovery: DiscoverySettings | bool | None = None
    """Re-resolve base URLs that are DNS names into one member per address, in the
    background (``DiscoverySettings``; True: the defaults). Off by default."""
    kv_events: str | int | None = None
    """Read every server's KV events (vLLM's ``--kv-events-config``, ZMQ; the
    ``pdclient[kv-events]`` extra), so ``auto`` knows what a decode endpoint still holds of
    a conversation instead of estimating it (``PDTrace.cache_source``): ``"discover"`` (ask
    each server's ``GET /kv_event_sources``), an address template on the endpoint's host
    (``"tcp://{host}:5557"``, with the replay socket after a comma:
    ``"tcp://{host}:5557,tcp://{host}:5558"``) or a port. None (the default): off."""
    max_decode_migrations: int = 1
    """How many times one streamed call may move to another decode endpoint after its stream
    broke, continuing the answer token for token (pdclient/migration/); 0 turns it off."""
    migrate_non_streamed: bool = False
    """Whether non-streamed calls may move too: their decode leg then streams and pdclient
    assembles the JSON body vLLM would have answered. Off by default: the decode server's API
    process spends ~1.4x the CPU on a streamed answer, the client ~30 us more per token; off,
    a non-streamed call whose decode dies is repeated whole by the openai SDK's max_retries."""
    remote_prefill: str = "auto"
    """Whether a chat or completions call gets a remote prefill: ``"auto"`` (the default): a
    chat call that extends a conversation the client remembers goes decode-only to the
    decode endpoint that answered its previous turn when few of its tokens are not in that
    server's prefix cache, every other call is a P/D handoff (``conversations``);
    ``"always"`` (every call is a P/D handoff, pdclient's first behaviour: no memory, no
    warm-ups) or ``"never"`` (every call goes decode-only, as the caller sent it)."""
    dispatch: str = "sequential"
    """How a P/D handoff sends its two legs: ``"sequential"`` (the default: the prefill,
    then, with its answer, the decode), ``"concurrent"`` (both at once, for vLLM's push mode,
    ``NixlPushConnector``: the decode server allocates its blocks and renders the prompt
    while the prefill runs, and the prefill server WRITEs the KV into them) or ``"auto"``
    (concurrent where the prefill endpoint's answers said it runs in push mode). A call is
    concurrent only to a prefill endpoint whose coordinates an earlier answer gave, so the
    first call to each is sequential; ``"concurrent"`` also trusts an endpoint whose answers
    do not say their transfer mode. See pdclient/handoff/_dispatch.py."""
    conversations: ConversationSettings = field(default_factory=ConversationSettings)
    """How ``"auto"`` decides (``threshold_tokens``, ``max_uncached_ratio``) and how the
    conversations are remembered (one memory per fleet, shared by the client's copies)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(
            self, "prefill_base_url", resolve_urls(self.prefill_base_url, argument="prefill_base_url", env=PREFILL_ENV)
        )
        set_(self, "decode_base_url", resolve_urls(self.decode_base_url, argument="decode_base_url", env=DECODE_ENV))
        set_(self, "on_prefill_failure", check_failure_policy(self.on_prefill_failure, "on_prefill_failure"))
        _check_type("allow_call_fallback_url", self.allow_call_fallback_url, bool)
        _check_type("allow_call_overrides", self.allow_call_overrides, bool)
        set_(self, "routing", _check_routing(self.routing))
        _check_type("breaker", self.breaker, BreakerSettings)
        _check_type("retries", self.retries, RetrySettings)
        if self.reuse_secret is None:
            set_(self, "reuse_secret", os.environ.get(SECRET_ENV) or None)
        elif not isinstance(self.reuse_secret, str) or not self.reuse_secret:
            raise PDConfigError("reuse_secret must be a non-empty string (or None for $PDCLIENT_REUSE_SECRET)")
        if self.on_trace is not None and not callable(self.on_trace):
            raise PDConfigError(f"on_trace must be callable, got {type(self.on_trace).__name__}")
        if isinstance(self.observers, PDObserver) or not isinstance(self.observers, Sequence | set | frozenset):
            raise PDConfigError(f"observers must be a list of PDObserver, got {type(self.observers).__name__}")
        for observer in self.observers:
            if not isinstance(observer, PDObserver):
                raise PDConfigError(f"observers: {observer!r} is not a PDObserver (subclass pdclient.PDObserver)")
        set_(self, "observers", tuple(self.observers))
        _check_fleet_options(self)
        set_(self, "kv_events", check_setting(self.kv_events))
        if self.kv_events is not None:
            import_zmq()
        check_migrations(self.max_decode_migrations, "max_decode_migrations")
        _check_type("migrate_non_streamed", self.migrate_non_streamed, bool)
        check_remote_prefill(self.remote_prefill, "remote_prefill")
        check_dispatch(self.dispatch, "dispatch")
        _check_type("conversations", self.conversations, ConversationSettings)

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return self.prefill_base_url  # type: ignore[return-value]

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return self.decode_base_url  # type: ignore[return-value]

    def policy_for(self, leg: str) -> str | RoutingPolicy:
        """The routing of ``leg`` (``prefill`` or ``decode``): its override, else ``routing``."""
        override: str | RoutingPolicy | None = getattr(self, f"{leg}_routing")
        return self.routing if override is None else override

    def load_settings_for(self, leg: str) -> ScrapeSettings | None:
        """How ``leg``'s pool is scraped, or None: not at all."""
        if isinstance(self.load_signals, ScrapeSettings):
            return self.load_signals
        if self.load_signals is None and wants_load_signals(self.policy_for(leg)):
            return ScrapeSettings()
        return None

    def replace(self, **changes: Any) -> PDOptions:
        """A copy with ``changes`` applied and validated; unknown names are a ``PDConfigError``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise PDConfigError(f"unknown PDOptions field(s): {sorted(unknown)}")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def call_override_refusal(call: CallOptions, client: PDOptions) -> str | None:
    """Why a call's own options may not apply under ``client``, or None.

    With ``allow_call_overrides`` off a call may only be more conservative than the
    client: fewer decode migrations; ``on_prefill_failure`` ``"fail"``, or the client's own
    (a fallback URL is ``allow_call_fallback_url``'s to allow); ``remote_prefill``
    ``"always"`` (the plain P/D handoff: no memory, no decode-only guess), or the client's
    own; ``dispatch`` ``"sequential"`` (the plain handoff), or the client's own.
    ``forward_ids`` and ``session`` always pass: without ids the decode server
    tokenizes the prompt itself as any plain vLLM call does, and a session only groups the
    caller's own calls (conversation keys are kept per tenant).
    """
    if client.allow_call_overrides:
        return None
    why = "allow_call_overrides is off: a call may only be more conservative than the client's options"
    migrations = call.max_decode_migrations
    if migrations is not None and migrations > client.max_decode_migrations:
        limit = client.max_decode_migrations
        return f"{CALL_OPTIONS_KEY}.max_decode_migrations may be at most {limit} here, not {migrations} ({why})"
    policy = call.on_prefill_failure
    if policy == "decode" and client.on_prefill_failure != "decode":
        return f'{CALL_OPTIONS_KEY}.on_prefill_failure may be "fail" here, not "decode" ({why})'
    mode = call.remote_prefill
    if mode is not None and mode not in ("always", client.remote_prefill):
        allowed = " or ".join(dict.fromkeys(("always", client.remote_prefill)))
        return f"{CALL_OPTIONS_KEY}.remote_prefill may be {allowed} here, not {mode} ({why})"
    dispatch = call.dispatch
    if dispatch is not None and dispatch not in ("sequential", client.dispatch):
        allowed = " or ".join(dict.fromkeys(("sequential", client.dispatch)))
        return f"{CALL_OPTIONS_KEY}.dispatch may be {allowed} here, not {dispatch} ({why})"
    return None
