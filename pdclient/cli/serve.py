"""`pdclient serve`: an OpenAI-compatible P/D proxy over HTTP (needs ``pdclient[serve]``).

    pdclient serve --prefill http://p:8100/v1 --decode http://d1:8200/v1 http://d2:8200/v1 --port 8000
    pdclient serve --config serve.toml --api-key "$KEY" --workers 4
    python -m pdclient serve ...

Settings come from a config file (``--config`` or ``$PDCLIENT_SERVE_CONFIG``, TOML or
JSON, keys as the flags without ``--``), then the environment (every setting as
``$PDCLIENT_SERVE_<NAME>``, e.g. ``$PDCLIENT_SERVE_PORT``; the URLs as
``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``, comma-separated, and
``$PDCLIENT_REUSE_SECRET``, as the library reads them), then flags, each overriding the one
before. The flags are
made from the settings (``pdclient.serve.SETTINGS``: ``PDOptions``'s fields, then the
proxy's own), so a setting has one name everywhere. Errors are raised; ``pdclient.cli.main``
reports them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import PDConfigError
from ..serve import CONFIG_FILE_ENV, SETTINGS, ServeConfig, Setting
from ._common import CLIError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, plus ``--config``; every default is SUPPRESS so the namespace
    holds only what was given (the config file and environment fill the rest)."""
    groups = {
        "client": parser.add_argument_group("the servers, and the client options (PDOptions)"),
        "proxy": parser.add_argument_group("the proxy"),
    }
    groups["proxy"].add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"settings file (.toml, or JSON); ${CONFIG_FILE_ENV}",
    )
    for setting in SETTINGS:
        default = "" if setting.default in ((), None) or setting.is_switch else f" (default: {setting.default})"
        env = f"; ${setting.env}" if setting.env else ""
        kwargs: dict[str, Any] = {
            "dest": setting.name,
            "default": argparse.SUPPRESS,
            "help": f"{setting.help}{default}{env}",
        }
        if setting.is_switch:
            # A switch that is on by default needs its --no- form to be turned off.
            kwargs["action"] = argparse.BooleanOptionalAction if setting.default is True else "store_true"
        elif setting.multiple:
            # --decode A B, --api-key K --api-key L: a list of strings, parsed with the rest.
            kwargs.update(metavar=setting.metavar, action="extend", nargs="+", type=str)
        else:
            kwargs.update(type=_parser_for(setting), metavar=setting.metavar, choices=setting.choices)
        groups[setting.group].add_argument(setting.option, **kwargs)


def _parser_for(setting: Setting) -> Any:
    def convert(text: str) -> Any:
        try:
            return setting.parse(text, setting.name)
        except PDConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config a parsed command line describes (with its config file and environment)."""
    names = {s.name for s in SETTINGS}
    given = {k: v for k, v in vars(args).items() if k in names}
    return ServeConfig.load(getattr(args, "config", None) or os.environ.get(CONFIG_FILE_ENV) or None, **given)


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
    config = config_from_args(args)
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CLIError(f"{exc.name} is missing: pip install 'pdclient[serve]'") from None
    from ..serve import run as serve

    serve(config)
    return 0
