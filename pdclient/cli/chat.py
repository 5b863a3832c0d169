"""`pdclient chat`: stream an answer from a P/D pair (or from a local pair started for it).

    pdclient chat --prefill http://p:8100/v1 --decode http://d:8200/v1 "Hi"
    pdclient chat --local "What is the capital of France?"             # starts a local pair
    echo "Hi" | pdclient chat --trace                                   # PDTrace to stderr
    pdclient chat                                                       # interactive, on a terminal

URLs default to ``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``; ``--local``
starts a ``pdclient.local.LocalPD`` pair (progress on stderr) and stops it on exit. The
pair is named the same way in ``bench`` and ``doctor`` (``pdclient.cli._common.open_pair``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from ._common import EXIT_ERROR, add_pair_arguments, open_client


def register(commands: Any) -> None:
    """Add the `chat` subcommand to the `pdclient` parser's subparsers."""
    chat = commands.add_parser(
        "chat",
        help="stream a chat answer through a P/D pair (--local: one started for it)",
        description="Stream an answer through PDChatClient, on --prefill/--decode (or their environment "
        "variables), or with --local on a local prefill+decode vLLM pair started for it and stopped afterwards.",
    )
    add_pair_arguments(chat)
    chat.add_argument("message", nargs="*", help="the user message (default: stdin, or interactive on a terminal)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--max-tokens", type=int, default=256, help="answer length limit (default: 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    chat.add_argument("--trace", action="store_true", help="print each call's PDTrace fields to stderr")
    chat.set_defaults(func=run)


def stream_answer(
    client: Any, model: str, messages: list[dict[str, str]], args: argparse.Namespace, out: TextIO
) -> str:
    parts: list[str] = []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature, stream=True
    )
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                out.write(parts[-1])
                out.flush()
    out.write("\n")
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    from .._trace import PDTrace

    traces: list[PDTrace] = []
    interactive = not args.message and sys.stdin.isatty()
    if args.message:
        first: str | None = " ".join(args.message)
    elif not interactive:
        first = sys.stdin.read().strip()
        if not first:
            print("pdclient chat: error: no message (give one, or pipe it on stdin)", file=sys.stderr)
            return EXIT_ERROR
    else:
        first = None
    with open_client(args, on_trace=traces.append) as (client, model):
        messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            text = first if first is not None else _prompt()
            first = None
            if text is None:
                return 0
            messages.append({"role": "user", "content": text})
            answer = stream_answer(client, model, messages, args, sys.stdout)
            messages.append({"role": "assistant", "content": answer})
            if args.trace and traces:
                print(" ".join(f"{k}={v}" for k, v in traces[-1].model_dump(mode="json").items()), file=sys.stderr)
            if not interactive:
                return 0


def _prompt() -> str | None:
    """The next line typed at the terminal; None at end of input or /exit."""
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return None
        if line in ("/exit", "/quit"):
            return None
        if line:
            return line
