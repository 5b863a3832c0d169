"""`pdclient serve`: an OpenAI-compatible P/D proxy over HTTP (needs ``pdclient[serve]``).

    pdclient serve --prefill http://p:8100/v1 --decode http://d1:8200/v1 http://d2:8200/v1 --port 8000
    pdclient serve --config serve.toml --api-key "$KEY" --workers 4
    python -m pdclient serve ...

Settings come from a config file (``--config``, TOML or JSON, keys as the flags without
``--``), then the environment (``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``
comma-separated, ``$PDCLIENT_SERVE_API_KEYS``, ``$PDCLIENT_SERVE_UPSTREAM_API_KEY``,
``$PDCLIENT_REUSE_SECRET``), then flags, each overriding the one before. The flags are
made from ``ServeConfig``'s fields, so a setting has one name everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .._errors import PDConfigError
from ..serve._config import ServeConfig

EXIT_CONFIG = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServeConfig`` field, plus ``--config``; every default is SUPPRESS so
    the namespace holds only what was given (the config file and environment fill the rest)."""
    groups = {
        "client": parser.add_argument_group("servers and client options (those of the P/D transport)"),
        "proxy": parser.add_argument_group("the proxy"),
    }
    groups["proxy"].add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS, help="settings file (.toml, or JSON)"
    )
    for f in dataclasses.fields(ServeConfig):
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        default = "" if f.default in ((), None) else f" (default: {f.default})"
        env = f"; ${meta['env']}" if meta["env"] else ""
        kwargs["help"] = f"{meta['help']}{default}{env}"
        if f.type == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _parser_for(f)
            kind = {"_int": "N", "_float": "SECONDS", "_optional_float": "SECONDS"}.get(meta["parse"].__name__)
            kwargs["metavar"] = meta["metavar"] or (None if meta["choices"] else kind or f.name.upper())
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if f.name in ("prefill", "decode"):
                kwargs.update(nargs="+", action="extend", type=str)
            elif f.name == "api_keys":
                kwargs.update(action="append", type=str)
        groups[meta["group"]].add_argument(flag, **kwargs)


def _parser_for(f: dataclasses.Field[Any]) -> Any:
    parse = f.metadata["parse"]

    def convert(text: str) -> Any:
        try:
            return parse(text, f.name)
        except PDConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config a parsed command line describes (with its config file and environment)."""
    names = {f.name for f in dataclasses.fields(ServeConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return ServeConfig.load(getattr(args, "config", None), **given)


def register(commands: Any) -> None:
    """Add the `serve` subcommand to the `pdclient` parser's subparsers."""
    serve = commands.add_parser(
        "serve",
        help="run an OpenAI-compatible proxy that splits chat and completions calls into P/D legs",
        description="An OpenAI-compatible HTTP proxy in front of vLLM prefill and decode servers: chat and "
        "completions calls go through the P/D handoff (the prefill's token ids forwarded to decode), every other "
        "/v1 request to a decode server. /health, /ready and /metrics (Prometheus) beside /v1. "
        "Settings: --config FILE, then environment variables, then flags.",
    )
    add_arguments(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except PDConfigError as exc:
        print(f"pdclient serve: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"pdclient serve: error: {exc.name} is missing: pip install 'pdclient[serve]'", file=sys.stderr)
        return EXIT_CONFIG
    from .serve import _run

    _run.run(config)
    return 0
