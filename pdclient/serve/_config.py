"""``ServeConfig``: every setting of ``pdclient serve``, from a config file, the environment
and flags (in rising precedence), validated once.

Each field's metadata says how it is spelled as a flag, which environment variable may
give it, and how a string becomes its value; the CLI builds its flags from it and a
config file (TOML or JSON) uses the field names as keys (``-`` or ``_``). Nothing here
imports the server's dependencies, so the CLI can describe itself without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import _bridge
from .._endpoints import DECODE_ENV, POLICIES, PREFILL_ENV, BreakerSettings, normalise_url
from .._errors import PDConfigError
from .._retry import RetrySettings
from .._signing import SECRET_ENV

API_KEYS_ENV = "PDCLIENT_SERVE_API_KEYS"
UPSTREAM_API_KEY_ENV = "PDCLIENT_SERVE_UPSTREAM_API_KEY"
CONFIG_ENV = "PDCLIENT_SERVE_CONFIG"
"""The resolved config as JSON, for the worker processes of ``--workers N``."""

_BREAKER = BreakerSettings()
_RETRIES = RetrySettings()


def _urls(value: object, source: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise PDConfigError(f"{source}: expected URLs (a list, or a comma-separated string), got {value!r}")
    return tuple(normalise_url(item.strip() if isinstance(item, str) else item, source) for item in items if item)


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


Parse = Callable[[object, str], Any]


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
) -> Any:
    """A field with what the CLI and the config loaders need to know about it."""
    meta = {"help": help, "parse": parse, "env": env, "choices": choices, "flag": flag, "metavar": metavar}
    return field(default=default, metadata={**meta, "group": group})


@dataclass(frozen=True)
class ServeConfig:
    """The proxy's settings; ``client options`` are those of ``AsyncPDTransport``."""

    # -- endpoints and client options (AsyncPDTransport's) --
    prefill: tuple[str, ...] = _opt(
        (), "prefill base URL(s), e.g. http://p:8100/v1", _urls, env=PREFILL_ENV, metavar="URL", group="client"
    )
    decode: tuple[str, ...] = _opt(
        (), "decode base URL(s), e.g. http://d:8200/v1", _urls, env=DECODE_ENV, metavar="URL", group="client"
    )
    on_prefill_failure: str = _opt(
        "decode",
        "when the prefill fails for good: decode (decode-only, the default), fail (an error), or a fallback base URL",
        _str,
        metavar="POLICY",
        group="client",
    )
    routing: str = _opt(
        "least_outstanding", "how a pool picks an endpoint", _str, choices=tuple(sorted(POLICIES)), group="client"
    )
    breaker_failures: int = _opt(
        _BREAKER.failures, "consecutive failures that open an endpoint's breaker", _int, group="client"
    )
    breaker_cooldown: float = _opt(
        _BREAKER.cooldown, "seconds an open breaker waits before letting a probe through", _float, group="client"
    )
    prefill_attempts: int = _opt(_RETRIES.prefill_attempts, "attempts of the prefill leg", _int, group="client")
    decode_attempts: int = _opt(
        _RETRIES.decode_attempts, "attempts to open the decode leg (connect errors only)", _int, group="client"
    )
    backoff_initial: float = _opt(_RETRIES.backoff_initial, "first retry backoff, seconds", _float, group="client")
    backoff_max: float = _opt(_RETRIES.backoff_max, "largest retry backoff, seconds", _float, group="client")
    prefill_timeout: float | None = _opt(
        _RETRIES.prefill_timeout,
        "bound on the whole prefill phase, retries included, seconds ('none': only --timeout)",
        _optional_float,
        group="client",
    )
    reuse_secret: str | None = _opt(
        None, "HMAC secret signing kv_transfer_params (servers with the guard)", _optional_str, env=SECRET_ENV,
        metavar="SECRET", group="client",
    )  # fmt: skip
    timeout: float = _opt(600.0, "read/write timeout of each leg request, seconds", _float, group="client")
    connect_timeout: float = _opt(5.0, "connect timeout of each leg request, seconds", _float, group="client")
    max_connections: int = _opt(1000, "connections the proxy keeps to the servers, at most", _int, group="client")

    # -- the proxy --
    host: str = _opt("127.0.0.1", "address to listen on", _str)
    port: int = _opt(8000, "port to listen on (0: any free port)", _int, metavar="PORT")
    workers: int = _opt(1, "worker processes (metrics aggregated across them)", _int)
    grace_period: float = _opt(
        30.0, "on SIGTERM, seconds in-flight requests get to finish before they are closed", _float
    )
    max_body_size: int = _opt(32 * 1024 * 1024, "largest request body accepted (413 above)", _int, metavar="BYTES")
    api_keys: tuple[str, ...] = _opt(
        (),
        f"a key callers must send as 'Authorization: Bearer KEY' on /v1 (repeatable; ${API_KEYS_ENV}: comma-separated)",
        _strings,
        env=API_KEYS_ENV,
        flag="--api-key",
        metavar="KEY",
    )
    forward_api_key: bool = _opt(False, "forward the caller's Authorization header to the servers", _bool)
    upstream_api_key: str | None = _opt(
        None, "send 'Authorization: Bearer KEY' to the servers", _optional_str, env=UPSTREAM_API_KEY_ENV, metavar="KEY"
    )
    trace_headers: bool = _opt(False, "return the x-pd-* trace headers (they name the servers) to callers", _bool)
    log_format: str = _opt("text", "log lines as text or as JSON objects", _str, choices=("text", "json"))
    log_level: str = _opt("info", "log level", _str, choices=("critical", "error", "warning", "info", "debug"))

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise PDConfigError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        if not self.prefill:
            raise PDConfigError(f"prefill: give at least one URL (--prefill, or ${PREFILL_ENV})")
        if not self.decode:
            raise PDConfigError(f"decode: give at least one URL (--decode, or ${DECODE_ENV})")
        if not 0 <= self.port <= 65535:
            raise PDConfigError(f"port must be 0-65535, got {self.port}")
        if self.workers < 1:
            raise PDConfigError(f"workers must be at least 1, got {self.workers}")
        if self.grace_period < 0 or self.max_body_size < 1 or self.max_connections < 1:
            raise PDConfigError("grace_period must be >= 0, max_body_size and max_connections >= 1")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise PDConfigError("timeout and connect_timeout must be positive")
        if self.forward_api_key and self.upstream_api_key:
            raise PDConfigError("give either forward_api_key or upstream_api_key, not both")
        _bridge.check_options(self.prefill, self.decode, self.transport_options())

    def transport_options(self) -> dict[str, Any]:
        """The client options as the transport takes them."""
        return _bridge.transport_options(
            on_prefill_failure=self.on_prefill_failure,
            routing=self.routing,
            breaker_failures=self.breaker_failures,
            breaker_cooldown=self.breaker_cooldown,
            prefill_attempts=self.prefill_attempts,
            decode_attempts=self.decode_attempts,
            backoff_initial=self.backoff_initial,
            backoff_max=self.backoff_max,
            prefill_timeout=self.prefill_timeout,
            reuse_secret=self.reuse_secret,
        )

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> ServeConfig:
        """A config from field names (``-`` or ``_``) to values, each parsed as its field says."""
        known = {f.name: f for f in fields(cls)}
        parsed: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise PDConfigError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
            parsed[name] = known[name].metadata["parse"](value, f"{source}: {key}")
        return cls(**parsed)

    @classmethod
    def load(
        cls,
        config_file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **given: Any,
    ) -> ServeConfig:
        """Defaults, then the config file, then the environment, then ``given`` (flags) on top."""
        values: dict[str, Any] = {}
        if config_file is not None:
            values.update({k.replace("-", "_"): v for k, v in read_config_file(config_file).items()})
        environ = os.environ if environ is None else environ
        for f in fields(cls):
            env = f.metadata.get("env")
            if env and environ.get(env):
                values[f.name] = environ[env]
        values.update(given)
        return cls.from_mapping(values)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return cls.from_mapping(json.loads(text), source=CONFIG_ENV)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of settings: one table/object, keys as the field names."""
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
