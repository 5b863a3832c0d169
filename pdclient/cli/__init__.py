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
import logging
import sys
from collections.abc import Sequence

from .. import __version__
from .._errors import PDConfigError
from ._common import EXIT_ERROR, CLIError

EXIT_INTERRUPTED = 130


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
