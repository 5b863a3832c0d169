"""Cancel-safe handoff on the real pair: a call abandoned between its legs frees the prefill's KV.

With NIXL, the prefill server keeps a finished prefill's KV blocks until a decode pulls
them (or until the connector's lease runs out, minutes later). Here the decode leg is
held back, the prefill's blocks are seen pinned in the prefill server's
``vllm:kv_cache_usage_perc``, then the call's task is cancelled: pdclient's one-token
decode, sent before the cancel goes on, pulls the blocks and the usage returns to idle.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pdclient import AsyncPDTransport, PDOptions, PDTrace
from pdclient.local import PDServers

from .helpers import metric

KV_USAGE = "vllm:kv_cache_usage_perc"


class HoldTheDecode(httpx.AsyncBaseTransport):
    """Leg transport that sends prefills at once and holds the call's own decode forever."""

    def __init__(self, decode_url: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.decode_url = decode_url
        self.decode_held = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        is_decode = str(request.url).startswith(self.decode_url)
        if is_decode and json.loads(request.content).get("max_tokens") != 1:  # 1 token: the release
            self.decode_held.set()
            await asyncio.sleep(3600)
        return await self.inner.handle_async_request(request)


async def wait_for_usage(url: str, done: object, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    usage = metric(url, KV_USAGE)
    while not done(usage) and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.25)
        usage = await asyncio.to_thread(metric, url, KV_USAGE)
    return usage


@pytest.mark.timeout(300)
async def test_cancel_between_legs_frees_the_prefill_kv(pd: PDServers) -> None:
    assert await wait_for_usage(pd.prefill_url, lambda u: u == 0, 60) == 0, "prefill KV idle before the test"
    legs = HoldTheDecode(pd.decode_url)
    traces: list[PDTrace] = []
    options = PDOptions(pd.prefill_url, pd.decode_url, on_trace=traces.append)
    transport = AsyncPDTransport(options=options, leg_transport=legs)
    client = openai.AsyncOpenAI(
        base_url=pd.decode_url, api_key="EMPTY", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
    )
    prompt = f"Summarise this, {time.time()}: " + "the quick brown fox jumps over the lazy dog. " * 60
    call = asyncio.create_task(
        client.chat.completions.create(
            model=pd.model, messages=[{"role": "user", "content": prompt}], max_tokens=32, stream=True
        )
    )
    await asyncio.wait_for(legs.decode_held.wait(), 240)
    pinned = metric(pd.prefill_url, KV_USAGE)
    assert pinned > 0, "the finished prefill holds KV blocks for the remote decode"

    cancelled_at = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    usage = await wait_for_usage(pd.prefill_url, lambda u: u == 0, 60)
    freed_after = time.monotonic() - cancelled_at
    print(f"\nprefill KV usage {pinned:.4f} while held; {usage:.4f} {freed_after:.1f} s after the cancel")
    assert usage == 0, f"prefill KV still {usage} {freed_after:.0f} s after the cancel"
    assert freed_after < 30
    assert traces[-1].error == "CancelledError"
    await client.close()
