"""`pdclient chat`: stream an answer from a P/D pair (or from a local pair started for it).

    pdclient chat "What is the capital of France?"                      # local pair (starts one)
    pdclient chat --prefill http://p:8100/v1 --decode http://d:8200/v1 "Hi"
    echo "Hi" | pdclient chat --trace                                   # PDTrace to stderr
    pdclient chat                                                       # interactive, on a terminal

URLs default to ``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``; with
neither, a ``pdclient.local.LocalPD`` pair is started (progress on stderr) and stopped
on exit. Failures are one line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from ._endpoints import DECODE_ENV, PREFILL_ENV

EXIT_ERROR = 1


class CLIError(Exception):
    """A failure to report as one line."""


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint arguments shared by `chat` and `bench`."""
    parser.add_argument("--prefill", metavar="URL", help=f"prefill base URL (default: ${PREFILL_ENV})")
    parser.add_argument("--decode", metavar="URL", help=f"decode base URL (default: ${DECODE_ENV})")
    parser.add_argument("--model", help="model name (default: the first one the decode server lists)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="bearer token for both servers (default: $OPENAI_API_KEY or EMPTY)",
    )


def register(commands: Any) -> None:
    """Add the `chat` subcommand to the `pdclient` parser's subparsers."""
    chat = commands.add_parser(
        "chat",
        help="stream a chat answer through a P/D pair (a local one when no URLs are given)",
        description="Stream an answer through PDChatClient. Without --prefill/--decode (or their environment "
        "variables) a local prefill+decode vLLM pair is started for the call and stopped afterwards.",
    )
    add_pair_arguments(chat)
    chat.add_argument("message", nargs="*", help="the user message (default: stdin, or interactive on a terminal)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--max-tokens", type=int, default=256, help="answer length limit (default: 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    chat.add_argument("--trace", action="store_true", help="print each call's PDTrace fields to stderr")
    chat.set_defaults(func=run)


@contextlib.contextmanager
def open_pair(args: argparse.Namespace, **client_args: Any) -> Iterator[tuple[Any, str]]:
    """A PDChatClient for the URLs given (or in the environment), else for a fresh LocalPD; and the model."""
    from . import PDChatClient

    prefill = args.prefill or os.environ.get(PREFILL_ENV)
    decode = args.decode or os.environ.get(DECODE_ENV)
    if bool(prefill) != bool(decode):
        raise CLIError("give both --prefill and --decode (or neither, to start a local pair)")
    if prefill and decode:
        with PDChatClient(prefill_base_url=prefill, decode_base_url=decode, api_key=args.api_key, **client_args) as c:
            yield c, args.model or first_model(c)
        return
    from .local import LocalPD

    # LocalPD reports its long steps (first-time setup, server starts) on this logger.
    logging.getLogger("pdclient.local").setLevel(logging.INFO)
    print("no --prefill/--decode given: starting a local prefill+decode pair (~1 min)", file=sys.stderr)
    with LocalPD() as pd, pd.client(**client_args) as client:
        yield client, args.model or pd.model


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
    if isinstance(error, CLIError):
        return str(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


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
    from ._trace import PDTrace

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
    try:
        with open_pair(args, on_trace=traces.append) as (client, model):
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
                    print(" ".join(f"{k}={v}" for k, v in traces[-1].model_dump().items()), file=sys.stderr)
                if not interactive:
                    return 0
    except KeyboardInterrupt:
        print("\npdclient chat: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line, not a traceback: this is the command's edge
        print(f"pdclient chat: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


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
