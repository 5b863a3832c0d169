"""Real prefill/decode vLLM servers on this machine, no GPU needed.

``LocalPD`` starts a prefill and a decode vLLM server on loopback (or more of each:
``LocalPD(decode_servers=2)``), each pinned to a core, KV moved between them by NIXL on
CPU buffers, and stops them on exit. Everything it needs is prepared on first use and
cached under ``~/.cache/pdclient`` (``PDCLIENT_CACHE_DIR`` overrides).
"""

from ._pair import LocalPD, StartStats

__all__ = ["LocalPD", "StartStats"]
