"""What the subcommands share: the arguments that name a pair, opening it or a client on it, the error
they report as one line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .. import PDConfigError
from .._durations import check_seconds
from ..pools import DECODE_ENV, PREFILL_ENV

if TYPE_CHECKING:
    from .._client import PDChatClient


EXIT_ERROR = 1


class CLIError(Exception):
    """A failure to report as one line."""


def seconds(flag: str) -> Any:
    """An argparse type for a duration flag, checked as every duration setting is."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected a number of seconds, got {text!r}") from None
        try:
            check_seconds(flag, value)
        except PDConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return convert


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that name a pair, the same for every subcommand that talks to one."""
    parser.add_argument("--prefill", metavar="URL", help=f"prefill base URL (default: ${PREFILL_ENV})")
    parser.add_argument("--decode", metavar="URL", help=f"decode base URL (default: ${DECODE_ENV})")
    parser.add_argument(
        "--local", action="store_true", help="start a local prefill+decode vLLM pair for the command (~1 min)"
    )
    parser.add_argument("--model", help="model name (default: the first one the decode server lists)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="bearer token for both servers (default: $OPENAI_API_KEY or EMPTY)",
    )


@contextlib.contextmanager
def open_pair(args: argparse.Namespace, **local_pd_args: Any) -> Iterator[tuple[str, str, str | None]]:
    """The pair a command names, as (prefill URL, decode URL, model or None): --prefill and
    --decode, else $PDCLIENT_PREFILL_BASE_URL / $PDCLIENT_DECODE_BASE_URL, else with --local a
    LocalPD started for the command (and stopped after it). Nothing is started unless asked."""
    given = (args.prefill, args.decode)
    if any(given) and not all(given):
        raise CLIError("give both --prefill and --decode (or neither)")
    prefill, decode = given if all(given) else (os.environ.get(PREFILL_ENV), os.environ.get(DECODE_ENV))
    if args.local:
        if prefill or decode:
            raise CLIError("--local starts a pair: give it without --prefill/--decode (or unset their variables)")
        from ..local import LocalPD

        # LocalPD reports its long steps (first-time setup, server starts) on this logger.
        logging.getLogger("pdclient.local").setLevel(logging.INFO)
        with LocalPD(**local_pd_args) as pair:
            yield pair.prefill_url, pair.decode_url, args.model or pair.model
        return
    if bool(prefill) != bool(decode):
        raise CLIError(f"${PREFILL_ENV} and ${DECODE_ENV} go together: set both, or give --prefill and --decode")
    if not prefill or not decode:
        raise CLIError(f"no pair: give --prefill and --decode (or set ${PREFILL_ENV} / ${DECODE_ENV}), or --local")
    yield prefill, decode, args.model


@contextlib.contextmanager
def open_client(
    args: argparse.Namespace, local_pd_args: Mapping[str, Any] | None = None, **client_args: Any
) -> Iterator[tuple[PDChatClient, str]]:
    """A PDChatClient for the pair the command names (``open_pair``), and the model to call."""
    from .. import PDChatClient

    with (
        open_pair(args, **(local_pd_args or {})) as (prefill, decode, model),
        PDChatClient(prefill_base_url=prefill, decode_base_url=decode, api_key=args.api_key, **client_args) as client,
    ):
        yield client, model or first_model(client)


def first_model(client: Any) -> str:
    models = client.models.list().data
    if not models:
        raise CLIError(f"the decode server at {client.base_url} serves no model; pass --model")
    return str(models[0].id)
