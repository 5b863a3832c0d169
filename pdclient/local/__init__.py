"""A real prefill/decode vLLM pair on this machine, no GPU needed.

``LocalPD`` starts two vLLM servers on loopback (prefill pinned to core 0, decode to
core 1, KV moved between them by NIXL on CPU buffers) and stops them on exit. Everything
it needs is prepared on first use and cached under ``~/.cache/pdclient``
(``PDCLIENT_CACHE_DIR`` overrides).
"""

from ._pair import LocalPD

__all__ = ["LocalPD"]
