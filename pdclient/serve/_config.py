"""``ServeConfig``: every setting of ``pdclient serve``, from a config file, the environment
and flags (in rising precedence), validated once.

The client options are a ``PDOptions`` (``ServeConfig.options``), not a list of their own:
the settings that spell them (``SETTINGS``, one flat name each, for flags and config
files) are generated from ``PDOptions``'s fields, a nested settings object's fields
flattened (``breaker.failures`` is ``breaker_failures``, ``retries.prefill_attempts`` is
``prefill_attempts``), and ``PDOptions`` validates them. The proxy's own settings are
``ServeConfig``'s other fields. A config file (TOML or JSON) uses the flat names as keys
(``-`` or ``_``). Nothing here imports the server's dependencies, so the CLI can describe
itself without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import PDConfigError, PDOptions
from .._durations import check_seconds
from ..pools import DECODE_ENV, PREFILL_ENV
from ..routing import POLICIES, prefill_only

# Constants with no public name: the environment variables PDOptions reads, the policy names.
from ..wire import DISPATCH_MODES, REMOTE_PREFILL_MODES, SECRET_ENV

ENV_PREFIX = "PDCLIENT_SERVE_"
"""Every setting is also ``$PDCLIENT_SERVE_<NAME>`` (``--log-format`` is
``$PDCLIENT_SERVE_LOG_FORMAT``), except those PDOptions itself reads from the environment
(the base URLs, the reuse secret), which keep their one name."""
API_KEYS_ENV = "PDCLIENT_SERVE_API_KEYS"
UPSTREAM_API_KEY_ENV = "PDCLIENT_SERVE_UPSTREAM_API_KEY"
CONFIG_FILE_ENV = "PDCLIENT_SERVE_CONFIG"
"""The settings file, as ``--config`` names it."""
CONFIG_ENV = "_PDCLIENT_SERVE_WORKER_CONFIG"
"""Internal, not a setting: the resolved config as JSON, for the worker processes of ``--workers N``."""


# -- parsing one value -------------------------------------------------------------------


def _strings(value: object, source: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise PDConfigError(f"{source}: expected strings (a list, or a comma-separated string), got {value!r}")
    return tuple(i.strip() for i in items if i.strip())


def _int(value: object, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).replace("_", ""))
    except ValueError:
        raise PDConfigError(f"{source}: expected an integer, got {value!r}") from None


def _float(value: object, source: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        raise PDConfigError(f"{source}: expected a number, got {value!r}") from None


def _optional_int(value: object, source: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _int(value, source)


def _optional_float(value: object, source: str) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _float(value, source)


def _bool(value: object, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise PDConfigError(f"{source}: expected true or false, got {value!r}")


def _str(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise PDConfigError(f"{source}: expected a string, got {value!r}")
    return value


def _optional_str(value: object, source: str) -> str | None:
    return None if value is None else _str(value, source) or None


def _keys(value: object, source: str) -> tuple[str, ...]:
    """Keys, comma-separated or a list: given, the setting must hold at least one and no empty
    one (an empty Secret must not start a proxy whose /v1 is open)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise PDConfigError(f"{source}: expected keys (a list, or a comma-separated string), got {value!r}")
    keys = tuple(i.strip() for i in items)
    if not keys or not all(keys):
        raise PDConfigError(
            f"{source}: an empty key in {value!r}: give at least one key and no empty one, "
            "or leave the setting out for no keys"
        )
    return keys


def _key(value: object, source: str) -> str | None:
    """A key or secret: given, it must not be empty (None: not set, as a worker's copy says)."""
    if value is None:
        return None
    if not _str(value, source).strip():
        raise PDConfigError(f"{source}: empty: give the key, or leave the setting out for none")
    return value  # type: ignore[return-value]


def _on_off_default(value: object, source: str) -> bool | None:
    """A background feature: on (its default settings), off, or ``auto`` (None: PDOptions decides)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "auto")):
        return None
    return _bool(value, source)


Parse = Callable[[object, str], Any]

# A PDOptions field's annotation (a string: postponed annotations) -> how a flag's text becomes its value.
_PARSERS: Mapping[str, Parse] = {
    "int": _int,
    "float": _float,
    "float | None": _optional_float,
    "int | None": _optional_int,
    "bool": _bool,
    "str": _str,
    "str | None": _optional_str,
}
_METAVARS: Mapping[Parse, str] = {_int: "N", _optional_int: "N", _float: "SECONDS", _optional_float: "SECONDS"}


@dataclass(frozen=True)
class Setting:
    """One flat setting: a flag (``--name``), a config-file key, maybe an environment variable."""

    name: str
    help: str
    parse: Parse
    default: Any
    path: tuple[str, ...]
    """Where the value goes: ``("options", "breaker", "failures")``, or ``("port",)`` for the proxy's own."""
    env: str | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None
    metavar: str | None = None
    group: str = "proxy"
    multiple: bool = False
    """Given as several values (``--decode A B``, ``--api-key K`` repeated, or a list in a file)."""
    secret: bool = False
    """A key or secret: its variable counts as given when set at all, so an empty one (a
    Secret with no value) is an error, never the same as no key."""

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A true/false setting: a flag without a value on the command line."""
        return self.parse is _bool


# -- the client options, generated from PDOptions ------------------------------------------

# PDOptions fields the proxy does not take from settings: objects (no command-line form),
# or the proxy's to set: a caller must never choose where the proxy sends requests, and
# callers' per-call options are allowed by a setting of the proxy's own, off by default.
_NOT_SETTINGS = ("on_trace", "observers", "allow_call_fallback_url", "allow_call_overrides")
# Nested settings objects flattened with a prefix (their own field names are ambiguous alone).
_PREFIXED = {"breaker": "breaker_", "conversations": "conversation_"}
_NAMES = {"prefill_base_url": "prefill", "decode_base_url": "decode"}
# Nested settings whose flag reads better without the prefix (an operator's budget, not a memory knob).
_UNPREFIXED = {"conversations": ("max_decode_stall_share", "max_decode_stall_ms")}


def _urls(value: object, source: str) -> tuple[str, ...]:
    """URLs as given (PDOptions normalises and checks them)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise PDConfigError(f"{source}: expected URLs (a list, or a comma-separated string), got {value!r}")
    return tuple(i.strip() for i in items if i.strip())


def _kv_events(value: object, source: str) -> str | int | None:
    """``off``/``none``: None; a number: a port; else the text (PDOptions checks it)."""
    if value is None or isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise PDConfigError(f"{source}: expected 'discover', a port or an address template, got {value!r}")
    text = value.strip()
    if text.lower() in ("off", "none", ""):
        return None
    return int(text) if text.isdigit() else text


_SPECIAL: Mapping[str, dict[str, Any]] = {
    "prefill": {"parse": _urls, "env": PREFILL_ENV, "metavar": "URL", "multiple": True, "default": ()},
    "decode": {"parse": _urls, "env": DECODE_ENV, "metavar": "URL", "multiple": True, "default": ()},
    # Each leg's flag offers only the policies that route that leg (cache_aware is prefill only).
    "routing": {"parse": _str, "choices": tuple(sorted(POLICIES.keys() - prefill_only()))},
    "prefill_routing": {"parse": _optional_str, "choices": tuple(sorted(POLICIES)), "metavar": "POLICY"},
    "decode_routing": {
        "parse": _optional_str,
        "choices": tuple(sorted(POLICIES.keys() - prefill_only())),
        "metavar": "POLICY",
    },
    "load_signals": {"parse": _on_off_default, "metavar": "on|off|auto"},
    "health_checks": {"parse": _on_off_default, "metavar": "on|off"},
    "discovery": {"parse": _on_off_default, "metavar": "on|off"},
    "on_prefill_failure": {"metavar": "POLICY"},
    "reuse_secret": {"parse": _key, "env": SECRET_ENV, "metavar": "SECRET", "secret": True},
    "remote_prefill": {"parse": _str, "choices": REMOTE_PREFILL_MODES},
    "dispatch": {"parse": _str, "choices": DISPATCH_MODES},
    "kv_events": {"parse": _kv_events, "metavar": "discover|PORT|ADDRESS"},
    "conversation_max_uncached_ratio": {"metavar": "RATIO"},
    "max_decode_stall_share": {"metavar": "SHARE"},
    "max_decode_stall_ms": {"metavar": "MS"},
    "conversation_initial_chars_per_token": {"metavar": "RATIO"},
}

_CLIENT_HELP: Mapping[str, str] = {
    "prefill": "prefill base URL(s), e.g. http://p:8100/v1",
    "decode": "decode base URL(s), e.g. http://d:8200/v1",
    "on_prefill_failure": "when the prefill fails for good: decode (decode-only), fail (an error), "
    "or a fallback base URL",
    "routing": "how a pool picks an endpoint",
    "prefill_routing": "the prefill pool's policy (default: --routing); cache_aware is prefill only",
    "decode_routing": "the decode pool's policy (default: --routing)",
    "load_signals": "scrape every server's /metrics (on), never (off), or only for load_aware pools (auto)",
    "health_checks": "probe every server's /health, feeding its breaker (default settings when on)",
    "discovery": "a DNS name in a URL becomes one endpoint per address, re-resolved (default settings when on)",
    "breaker_failures": "consecutive failures that open an endpoint's breaker",
    "breaker_cooldown": "seconds an open breaker waits before letting a probe through",
    "prefill_attempts": "attempts of the prefill leg",
    "decode_attempts": "attempts to open the decode leg (connect errors only)",
    "backoff_initial": "first retry backoff, seconds",
    "backoff_max": "largest retry backoff, seconds",
    "prefill_timeout": "bound on the whole prefill phase, retries included, seconds ('none': only --timeout)",
    "reuse_secret": "HMAC secret signing kv_transfer_params (servers with the guard) and keying Responses id tags",
    "max_decode_migrations": "times one streamed call may move to another decode endpoint after its stream broke "
    "(0: never)",
    "migrate_non_streamed": "non-streamed calls may move too (their decode leg streams; ~1.4x the decode API's CPU)",
    "remote_prefill": "always: every chat/completions call is a P/D handoff; never: decode-only; auto: a chat call "
    "extending a remembered conversation goes decode-only to the decode endpoint holding it when that is predicted "
    "faster and within the stall budget (--max-decode-stall-share)",
    "kv_events": "read every server's KV events (vLLM --kv-events-config; pdclient[kv-events]): 'discover' "
    "(GET /kv_event_sources), a port, or 'tcp://{host}:PUB[,tcp://{host}:REPLAY]'; auto then knows what a "
    "decode server holds",
    "dispatch": "sequential: the prefill, then the decode; concurrent: both at once (vLLM's NixlPushConnector "
    "on both servers); auto: where the prefill's answers say push mode, the mode "
    "whose learnt time to first token on that prefill endpoint is lower",
    "max_decode_stall_share": "auto: a call goes decode-only only if the decode server's running streams would wait "
    "at most this share of their answers' time (learnt) while it computes the call's uncached tokens (0: never "
    "while streams run)",
    "max_decode_stall_ms": "auto: a fixed budget in ms instead of --max-decode-stall-share (default: none)",
    "conversation_threshold_tokens": "auto: a fixed cap: a call with at least this many estimated uncached tokens "
    "is a handoff whatever the costs say (default: none)",
    "conversation_max_uncached_ratio": "auto: a call with at least this fraction of its prompt uncached is a handoff",
    "conversation_block_size": "the decode servers' KV block size (vLLM: 128 on CPU, 16 on GPU by default)",
    "conversation_max_conversations": "conversations remembered (LRU, about 400 bytes each)",
    "conversation_ratio_warmup": "server counts before the learned chars-per-token ratio loses its 25%% margin",
    "conversation_initial_chars_per_token": "the ratio before the first server count (low: over-estimates tokens)",
    "conversation_ratio_window": "a tenant's recent server counts its learned ratio is computed over",
    "conversation_overhead_tokens_per_message": "template tokens added per message to every estimate",
    "conversation_unseen_history_tokens": "auto: of a call's history this process did not see answered, at most "
    "this many tokens count as cached (0: none)",
    "conversation_warm_prefill": "auto: a decode-only call's prompt also goes to the prefill server, off its path",
}


def _default_of(name: str) -> Any:
    f = PDOptions.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _client_settings() -> list[Setting]:
    """One setting per PDOptions field (a nested settings object's fields flattened)."""
    settings: list[Setting] = []
    for f in fields(PDOptions):
        if f.name in _NOT_SETTINGS:
            continue
        default = _default_of(f.name)
        if dataclasses.is_dataclass(default):
            prefix = _PREFIXED.get(f.name, "")
            for child in fields(default):
                value = getattr(default, child.name)
                name = child.name if child.name in _UNPREFIXED.get(f.name, ()) else prefix + child.name
                settings.append(_setting(name, str(child.type), value, (f.name, child.name)))
        else:
            settings.append(_setting(_NAMES.get(f.name, f.name), str(f.type), default, (f.name,)))
    return settings


def _setting(name: str, annotation: str, default: Any, path: tuple[str, ...]) -> Setting:
    special = dict(_SPECIAL.get(name, {}))
    parse = special.pop("parse", None) or _PARSERS.get(annotation)
    if parse is None or name not in _CLIENT_HELP:
        # A new PDOptions field: give it a parser and a help line here, or list it in _NOT_SETTINGS.
        raise TypeError(f"pdclient serve has no setting for PDOptions field {'.'.join(path)} ({annotation})")
    special.setdefault("default", default)
    special.setdefault("metavar", _METAVARS.get(parse))
    special.setdefault("env", ENV_PREFIX + name.upper())
    return Setting(name, _CLIENT_HELP[name], parse, path=("options", *path), group="client", **special)


# -- the proxy's own settings: ServeConfig's fields ------------------------------------------

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP field name (RFC 9110's token)."""
_ORIGIN = re.compile(r"https?://[^\s/?#@]+")
"""A web origin as a browser sends it: a scheme and a host (and port), no path."""


def _opt(
    default: Any,
    help: str,
    parse: Parse,
    *,
    env: str | None = None,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    group: str = "proxy",
    multiple: bool = False,
    secret: bool = False,
) -> Any:
    """A ServeConfig field with what its setting needs to know."""
    metavar = metavar or (None if choices else _METAVARS.get(parse))
    meta = {"help": help, "parse": parse, "env": env, "choices": choices, "flag": flag, "metavar": metavar}
    return field(default=default, metadata={**meta, "group": group, "multiple": multiple, "secret": secret})


@dataclass(frozen=True)
class ServeConfig:
    """The proxy's settings: the client options (``options``, a ``PDOptions``) and its own.

    ``ServeConfig.from_mapping({"prefill": [...], "decode": [...], "port": 9000})`` builds
    one from flat settings (as flags and config files spell them); ``load`` adds a config
    file and the environment.
    """

    options: PDOptions = field(metadata={"settings": True})
    """The P/D transport's options; the proxy adds its observers (metrics, the log line),
    turns ``allow_call_fallback_url`` off and sets ``allow_call_overrides`` from its own
    setting (whatever these options say)."""

    # -- connections to the servers --
    timeout: float = _opt(600.0, "read/write timeout of each leg request, seconds", _float, group="client")
    connect_timeout: float = _opt(5.0, "connect timeout of each leg request, seconds", _float, group="client")
    max_connections: int = _opt(1000, "connections the proxy keeps to the servers, at most", _int, group="client")
    allow_call_overrides: bool = _opt(
        False,
        "let callers' per-call options (extra_body {'pdclient': {...}}) loosen the settings: more decode "
        "migrations, decode-only after a failed prefill, another remote_prefill or dispatch (off: such an option "
        "is a 400)",
        _bool,
        group="client",
    )

    # -- the proxy --
    host: str = _opt("127.0.0.1", "address to listen on", _str, metavar="ADDRESS")
    port: int = _opt(8000, "port to listen on (0: any free port)", _int, metavar="PORT")
    workers: int = _opt(1, "worker processes (metrics aggregated across them)", _int)
    grace_period: float = _opt(
        30.0, "on SIGTERM, seconds in-flight requests get to finish before they are closed", _float
    )
    max_body_size: int = _opt(32 * 1024 * 1024, "largest request body accepted (413 above)", _int, metavar="BYTES")
    api_keys: tuple[str, ...] = _opt(
        (),
        "a key callers must send as 'Authorization: Bearer KEY' on /v1 (repeatable; the variable: comma-separated; "
        "an empty one is an error)",
        _keys,
        env=API_KEYS_ENV,
        flag="--api-key",
        metavar="KEY",
        multiple=True,
        secret=True,
    )
    forward_api_key: bool = _opt(False, "forward the caller's Authorization header to the servers", _bool)
    upstream_api_key: str | None = _opt(
        None,
        "send 'Authorization: Bearer KEY' to the servers (vLLM's --api-key)",
        _key,
        env=UPSTREAM_API_KEY_ENV,
        metavar="KEY",
        secret=True,
    )
    trace_headers: bool = _opt(
        False,
        "return the x-pd-* trace headers to callers, and error bodies with the failure's details (both name the "
        "servers; off: an error says which leg failed and how, nothing more)",
        _bool,
    )
    status_requires_api_key: bool = _opt(
        False,
        "/metrics, and /ready's list of the servers, answer only requests with an --api-key; without one /ready "
        "says only ready/degraded/draining (its status code is the probe's answer); /health never asks",
        _bool,
    )
    tenant_header: str | None = _opt(
        None,
        "the request header naming the caller's tenant (e.g. set by a gateway): conversations and cached prefixes "
        "are kept per tenant; a /v1 request without it is a 400 (default: the tenant is the caller's API key)",
        _optional_str,
        metavar="NAME",
    )
    # -- slow or many clients --
    header_timeout: float = _opt(
        10.0, "seconds a connection has to send a request's headers, from its first byte; then it is closed", _float
    )
    body_timeout: float = _opt(120.0, "seconds a request's body has to arrive in full after its headers (408)", _float)
    keep_alive_timeout: float = _opt(5.0, "seconds an idle connection is kept open between requests", _float)
    max_header_size: int = _opt(
        64 * 1024, "largest request line and headers accepted (431 above)", _int, metavar="BYTES"
    )
    max_client_connections: int = _opt(
        1024, "connections and requests each worker serves at once; beyond, requests get a 503 (0: no limit)", _int
    )
    ready_requires_prefill: bool = _opt(
        False,
        "/ready answers 503 whenever no prefill endpoint is admitted (by default only when the failure policy "
        "is 'fail': with 'decode' or a fallback URL the proxy still answers every call, degraded)",
        _bool,
    )
    allowed_origins: tuple[str, ...] = _opt(
        (),
        "web origins whose browser pages may call the proxy (CORS), e.g. https://app.example; '*' for any "
        "(default: none, no CORS headers)",
        _strings,
        metavar="ORIGIN",
        multiple=True,
    )
    log_format: str = _opt("text", "log lines as text or as JSON objects", _str, choices=("text", "json"))
    log_level: str = _opt("info", "log level", _str, choices=("critical", "error", "warning", "info", "debug"))
    otel: str = _opt(
        "auto",
        "OpenTelemetry spans for each call: on, off, or auto (on when the OTEL_* environment asks for traces, "
        "or a tracer provider is configured, e.g. by opentelemetry-instrument)",
        _str,
        choices=("auto", "on", "off"),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.options, PDOptions):
            raise PDConfigError(f"options must be a PDOptions, got {type(self.options).__name__}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise PDConfigError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        if not 0 <= self.port <= 65535:
            raise PDConfigError(f"port must be 0-65535, got {self.port}")
        if self.workers < 1:
            raise PDConfigError(f"workers must be at least 1, got {self.workers}")
        check_seconds("grace_period", self.grace_period, zero=True)
        for name in ("timeout", "connect_timeout", "header_timeout", "body_timeout", "keep_alive_timeout"):
            check_seconds(name, getattr(self, name))
        if self.max_body_size < 1 or self.max_connections < 1:
            raise PDConfigError("max_body_size and max_connections must be >= 1")
        if self.max_header_size < 1024:
            raise PDConfigError(f"max_header_size must be at least 1024 bytes, got {self.max_header_size}")
        if self.max_client_connections < 0:
            raise PDConfigError(f"max_client_connections must be >= 0 (0: no limit), got {self.max_client_connections}")
        if not all(isinstance(key, str) and key.strip() for key in self.api_keys):
            raise PDConfigError(f"api_keys: an empty key in {self.api_keys!r}")
        if self.upstream_api_key is not None and not self.upstream_api_key.strip():
            raise PDConfigError("upstream_api_key: empty: give the key, or None for none")
        if self.forward_api_key and self.upstream_api_key:
            raise PDConfigError("give either forward_api_key or upstream_api_key, not both")
        if self.status_requires_api_key and not self.api_keys:
            raise PDConfigError("status_requires_api_key needs at least one api_key (--api-key) to require")
        if self.tenant_header is not None and not _HEADER_NAME.fullmatch(self.tenant_header):
            raise PDConfigError(f"tenant_header must be an HTTP header name, got {self.tenant_header!r}")
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise PDConfigError(
                    f"allowed_origins: {origin!r} is not an origin: give scheme://host[:port] with no path "
                    "(e.g. https://app.example), or '*' for any"
                )

    # -- flat settings -------------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], source: str = "config", *, origins: Mapping[str, str] | None = None
    ) -> ServeConfig:
        """A config from flat setting names (``-`` or ``_``) to values, each parsed as its setting
        says; an error names ``origins[key]`` (where the value came from), else ``source: key``."""
        known = {s.name: s for s in SETTINGS}
        parsed: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise PDConfigError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
            parsed[name] = known[name].parse(value, (origins or {}).get(key) or f"{source}: {key}")
        for leg, env in (("prefill", PREFILL_ENV), ("decode", DECODE_ENV)):
            if not parsed.get(leg):
                raise PDConfigError(f"{leg}: give at least one URL (--{leg}, or ${env})")
        options: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        own: dict[str, Any] = {}
        for name, value in parsed.items():
            path = known[name].path
            if path[0] != "options":
                own[path[0]] = value
            elif len(path) == 2:
                options[path[1]] = value
            else:
                nested.setdefault(path[1], {})[path[2]] = value
        for name, children in nested.items():
            options[name] = dataclasses.replace(_default_of(name), **children)
        return cls(options=PDOptions(**options), **own)

    def to_mapping(self) -> dict[str, Any]:
        """The flat settings of this config (``from_mapping`` of it is an equal config).

        Raises ``PDConfigError`` when the options hold what no setting spells (observers,
        ``on_trace``, a ``RoutingPolicy`` object): those cannot reach worker processes.
        """
        opts = self.options
        if opts.observers or opts.on_trace is not None:
            raise PDConfigError(
                "options with observers or on_trace cannot be given to worker processes: "
                "run one worker (create_app), or use what the flags spell"
            )
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            value: Any = self
            for name in setting.path:
                value = getattr(value, name)
            if setting.secret and not value:
                continue  # no key: left out, as an operator leaves it out (given empty, it is an error)
            values[setting.name] = _spelled(setting, value)
        return values

    @classmethod
    def load(
        cls,
        config_file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **given: Any,
    ) -> ServeConfig:
        """Defaults, then the config file, then the environment, then ``given`` (flags) on top."""
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}  # where each value came from, for its error
        if config_file is not None:
            for key, value in read_config_file(config_file).items():
                values[key.replace("-", "_")] = value
                origins[key.replace("-", "_")] = f"config file {config_file}: {key}"
        environ = os.environ if environ is None else environ
        for setting in SETTINGS:
            # An empty variable is no setting, but for a key: an empty Secret must not mean "no key".
            if setting.env and (environ.get(setting.env) or (setting.secret and setting.env in environ)):
                values[setting.name] = environ[setting.env]
                origins[setting.name] = f"${setting.env}"
        flags = {s.name: s.option for s in SETTINGS}
        for name, value in given.items():
            values[name] = value
            origins[name] = flags.get(name, name)
        return cls.from_mapping(values, origins=origins)

    def to_json(self) -> str:
        return json.dumps(self.to_mapping())

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return cls.from_mapping(json.loads(text), source=CONFIG_ENV)


def _spelled(setting: Setting, value: Any) -> Any:
    """The flat value a config file would hold for ``value``; PDConfigError when none spells it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value == type(value)():
        value = True  # a background feature on with its default settings: "on"
    spelled = list(value) if isinstance(value, tuple) else value
    try:
        if setting.parse(spelled, setting.name) == value or value is True:
            return spelled
    except PDConfigError:
        pass
    raise PDConfigError(
        f"{setting.name}={value!r} cannot be given to worker processes (no flag spells it): "
        "run one worker (create_app), or use what the flags spell"
    )


def _own_settings() -> list[Setting]:
    return [
        Setting(
            f.name,
            f.metadata["help"],
            f.metadata["parse"],
            f.default,
            (f.name,),
            env=f.metadata["env"] or ENV_PREFIX + f.name.upper(),
            choices=f.metadata["choices"],
            flag=f.metadata["flag"],
            metavar=f.metadata["metavar"],
            group=f.metadata["group"],
            multiple=f.metadata["multiple"],
            secret=f.metadata["secret"],
        )
        for f in fields(ServeConfig)
        if "settings" not in f.metadata
    ]


SETTINGS: tuple[Setting, ...] = (*_client_settings(), *_own_settings())
"""Every setting of ``pdclient serve``: the client options (from ``PDOptions``), then the proxy's."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of settings: one table/object, keys as the setting names."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise PDConfigError(f"config file {file}: {exc.strerror or exc}") from None
    try:
        if file.suffix.lower() == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            data: object = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise PDConfigError(f"config file {file}: {exc}") from None
    if not isinstance(data, dict):
        raise PDConfigError(f"config file {file}: expected one table/object of settings")
    return data


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
