"""The least a Python P/D proxy on pdclient serve's stack does: a reference arm for bench_proxies.

    python benchmarks/bare_proxy.py PREFILL_URL DECODE_URL PORT

uvicorn (httptools, uvloop) and one aiohttp session, as ``pdclient serve`` runs on, with
its server's main loop (``pdclient.serve._server.Server``: it wakes once a minute, where
uvicorn's wakes ten times a second, a cost that grows with a call's length): each
chat call is a prefill (its ``kv_transfer_params`` read from the JSON answer) and a decode
whose chunks go to the caller as they arrive. No retries, timeouts, metrics, logs, usage,
migration or routing: what is left is the stack's own cost per call and per chunk, the
floor under pdclient serve's (``bench_proxies.py stubs --arms ...,bare proxy``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdclient.serve._server import Server

JSON = {"content-type": "application/json"}


def app_for(prefill: str, decode: str) -> Any:
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
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


if __name__ == "__main__":
    prefill_url, decode_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = uvicorn.Config(
        app_for(prefill_url, decode_url), host="127.0.0.1", port=port, log_level="warning",
        access_log=False, http="httptools", loop="uvloop",
    )  # fmt: skip
    Server(config).run()
