"""Where the examples find a P/D pair: yours, or a local one started for the example.

Set ``PDCLIENT_PREFILL_BASE_URL`` and ``PDCLIENT_DECODE_BASE_URL`` (and optionally
``PDCLIENT_MODEL``) to run an example against your own prefill/decode servers; otherwise
it starts a local pair with ``pdclient.local.LocalPD`` (about a minute; the first run also
prepares vLLM and the model) and stops it at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Pair:
    prefill_url: str
    decode_url: str
    model: str


@contextlib.contextmanager
def pd_pair(extra_server_args: Sequence[str] = ()) -> Iterator[Pair]:
    prefill = os.environ.get("PDCLIENT_PREFILL_BASE_URL")
    decode = os.environ.get("PDCLIENT_DECODE_BASE_URL")
    if prefill and decode:
        model = os.environ.get("PDCLIENT_MODEL")
        if not model:
            model = httpx.get(f"{decode.rstrip('/')}/models", timeout=30).json()["data"][0]["id"]
        yield Pair(prefill, decode, model)
        return
    from pdclient.local import LocalPD

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pdclient.local").setLevel(logging.INFO)  # progress of the long steps
    with LocalPD(extra_server_args=extra_server_args) as pd:
        yield Pair(pd.prefill_url, pd.decode_url, pd.model)
