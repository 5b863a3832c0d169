"""Real prefill/decode vLLM servers on this machine, no GPU needed.

``LocalPD`` starts a prefill and a decode vLLM server on loopback (or more of each:
``LocalPD(decode_servers=2)``), each pinned to a core, KV moved between them by NIXL on
CPU buffers, and stops them on exit. ``pair_from_env_or_local`` yields the servers named
by ``PDCLIENT_PREFILL_BASE_URL`` / ``PDCLIENT_DECODE_BASE_URL``, or else those of a LocalPD
it starts. Everything LocalPD needs is prepared on first use and cached under
``~/.cache/pdclient`` (``PDCLIENT_CACHE_DIR`` overrides): ``server_python()`` is the vLLM
server environment's interpreter and ``model_dir()`` the converted model, each built on
first use, for running other servers or tools beside the pair.
"""

from ._from_env import PDServers, pair_from_env_or_local
from ._pair import LocalPD, StartStats
from ._prepare import cache_dir, model_dir, server_python

__all__ = ["LocalPD", "PDServers", "StartStats", "cache_dir", "model_dir", "pair_from_env_or_local", "server_python"]
