"""The least a Python P/D proxy on pdclient serve's stack does: a reference arm for bench_proxies.

    python benchmarks/bare_proxy.py PREFILL_URL DECODE_URL PORT [--relay]

uvicorn (httptools, uvloop) and one aiohttp session, as ``pdclient serve`` runs on, with
its server's main loop (``pdclient.serve._server.Server``: it wakes once a minute, where
uvicorn's wakes ten times a second, a cost that grows with a call's length): each
chat call is a prefill (its ``kv_transfer_params`` read from the JSON answer) and a decode
whose chunks go to the caller as they arrive. No retries, timeouts, metrics, logs, usage,
migration or routing: what is left is the stack's own cost per call and per chunk, the
floor under pdclient serve's (``bench_proxies.py stubs --arms ...,bare proxy``).

``--relay`` (the arm ``bare proxy relayed``) measures what this stack's wake-up per chunk
costs: the decode's body goes from aiohttp's parser callback straight into uvicorn's
``send``, stepped there, with no future, no task step and no coroutine chain resumed per
chunk. On back-to-back stubs that is 15 us an event of 51 (Zen 4 EPYC); on stubs paced as
a decode streams (an event every 44 ms, the process asleep in between, so each wake-up
runs cold) it is ~70 us of ~250. The same relay built into ``pdclient serve`` gave 0.96x its
CPU a call on vLLM's multi-turn benchmark and 1.05x on those paced stubs, and is not kept
(docs/serve.md, "How it compares"). This arm reaches into aiohttp's ``StreamReader`` (its
class swapped for one whose ``feed_data`` hands the chunk on) and steps uvicorn's ``send``
outside a task with no flow control (a ``send`` that would wait fails the call): a
measurement on loopback stubs and nothing more.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvicorn
from aiohttp.streams import StreamReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdclient.serve._server import Server

JSON = {"content-type": "application/json"}
SINKS: dict[int, Callable[[bytes | None], None]] = {}
"""``--relay``: where each relayed body's chunks go, by its reader's id (the reader has slots only)."""


class _Relayed(StreamReader):
    """A body reader whose chunks go to its sink as they are parsed, not to its buffer."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        sink = SINKS.get(id(self))
        if sink is None:
            return super().feed_data(data, size)
        sink(data)
        return False

    def feed_eof(self) -> None:
        sink = SINKS.pop(id(self), None)
        super().feed_eof()
        if sink is not None:
            sink(None)


async def _relay(content: StreamReader, send: Any) -> None:
    """The rest of a body, each chunk sent from the reader's callback; returns at its end."""
    done = asyncio.get_running_loop().create_future()

    def sink(data: bytes | None) -> None:
        if data is None:
            if not done.done():
                done.set_result(None)
            return
        step = send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            step.send(None)
        except StopIteration:
            return
        step.close()
        raise RuntimeError("the caller's send would wait: --relay handles no flow control")

    if content._buffer:  # what arrived with the headers goes first
        await send({"type": "http.response.body", "body": content._read_nowait(-1), "more_body": True})
    if content.is_eof():
        return
    content.__class__ = _Relayed
    SINKS[id(content)] = sink
    await done


def app_for(prefill: str, decode: str, relay: bool = False) -> Any:
    sessions: list[aiohttp.ClientSession] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if not sessions:
            sessions.append(aiohttp.ClientSession())
        session = sessions[0]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        kv = {"do_remote_decode": True, "do_remote_prefill": False}
        first = {**request, "stream": False, "max_tokens": 1, "kv_transfer_params": kv}
        first.pop("stream_options", None)
        async with session.post(prefill + "/chat/completions", data=orjson.dumps(first), headers=JSON) as answer:
            params = orjson.loads(await answer.read()).get("kv_transfer_params")
        second = orjson.dumps({**request, "kv_transfer_params": params})
        async with session.post(decode + "/chat/completions", data=second, headers=JSON) as answer:
            headers = [(b"content-type", answer.headers.get("content-type", "application/json").encode())]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            if relay:
                await _relay(answer.content, send)
            else:
                async for chunk in answer.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


if __name__ == "__main__":
    prefill_url, decode_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = uvicorn.Config(
        app_for(prefill_url, decode_url, relay="--relay" in sys.argv[4:]), host="127.0.0.1", port=port,
        log_level="warning", access_log=False, http="httptools", loop="uvloop",
    )  # fmt: skip
    Server(config).run()
