"""Where the examples find a P/D pair: yours, or a local one started for the example.

Set ``PDCLIENT_PREFILL_BASE_URL`` and ``PDCLIENT_DECODE_BASE_URL`` (comma-separated lists
allowed; optionally ``PDCLIENT_MODEL``) to run an example against your own prefill/decode
servers; otherwise it starts a local pair with ``pdclient.local.LocalPD`` (about a minute;
the first run also prepares vLLM and the model) and stops it at the end. The choice is
``pdclient.local.pair_from_env_or_local``; this file only turns on progress logging.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from pdclient.local import PDServers, pair_from_env_or_local


@contextlib.contextmanager
def pd_pair(extra_server_args: Sequence[str] = ()) -> Iterator[PDServers]:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pdclient.local").setLevel(logging.INFO)  # progress of the long steps
    with pair_from_env_or_local(extra_server_args=extra_server_args) as pair:
        yield pair
