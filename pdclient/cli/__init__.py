"""The `pdclient` command line (also `python -m pdclient`): one module per subcommand.

    pdclient chat     stream an answer through a P/D pair
    pdclient bench    decode and client TTFT with and without forwarded ids, on a pair
    pdclient doctor   can this pair do a token-reusing handoff?
    pdclient serve    the handoff as an OpenAI-compatible P/D proxy, for clients in any language

chat, bench and doctor name their pair alike (``open_pair``): ``--prefill`` / ``--decode``,
else the environment, else ``--local`` to start one; nothing is started unless asked.

Each subcommand module has ``register(subparsers)`` and a ``run(args) -> int`` that raises
on failure; ``main`` reports every failure as one line on stderr with exit code 1, never a
traceback (a ``CLIError`` or ``PDConfigError`` as its message alone).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__
from .._endpoints import DECODE_ENV, PREFILL_ENV
from .._errors import PDConfigError

if TYPE_CHECKING:
    from .._client import PDChatClient

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A failure to report as one line."""


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


def one_line(error: BaseException) -> str:
    """An exception as one readable line, naming the failed leg when pdclient knows it."""
    import openai

    if isinstance(error, openai.APIStatusError):
        leg = error.response.headers.get("x-pd-failed-leg")
        where = f" (failed leg: {leg})" if leg else ""
        body = error.body if isinstance(error.body, dict) else {}
        message = body.get("message") or str(error)
        return f"HTTP {error.status_code}{where}: {message}"
    if isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error
        return f"cannot reach the server: {type(cause).__name__}: {cause}"
    if isinstance(error, CLIError | PDConfigError):
        return str(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def build_parser() -> argparse.ArgumentParser:
    from . import bench, chat, doctor, serve

    parser = argparse.ArgumentParser(
        prog="pdclient", description="Tools for prefill/decode disaggregated vLLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log HTTP requests and details")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (chat, bench, doctor, serve):
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        print(f"\npdclient {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # one line, not a traceback: this is the command's edge
        print(f"pdclient {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
