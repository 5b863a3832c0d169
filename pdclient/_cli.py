"""The `pdclient` command line (also `python -m pdclient`). One subcommand per function."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import run_doctor

    report = run_doctor(args.prefill, args.decode, args.model, api_key=args.api_key, timeout=args.timeout)
    print(report.table())
    return 0 if report.can_reuse_tokens else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdclient", description="Tools for prefill/decode disaggregated vLLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log HTTP requests and details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="check that a prefill/decode pair can do a token-reusing handoff",
        description="Probe a prefill and a decode server the way PDChatClient uses them and print one table. "
        "Exit code 0 only when the pair can do a token-reusing P/D handoff.",
    )
    doctor.add_argument(
        "--prefill", required=True, metavar="URL", help="prefill server base URL, e.g. http://host:8100/v1"
    )
    doctor.add_argument("--decode", required=True, metavar="URL", help="decode server base URL")
    doctor.add_argument("--model", help="model name (default: the first model both servers serve)")
    doctor.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token for both servers (default: $OPENAI_API_KEY)",
    )
    doctor.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request (default: 120)")
    doctor.set_defaults(func=_doctor)

    # Each other subcommand lives in its own module and adds itself here.
    from . import _cli_bench, _cli_chat, _cli_serve

    _cli_chat.register(commands)
    _cli_bench.register(commands)
    _cli_serve.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
