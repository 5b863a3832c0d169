"""Chain keys: a name for each whole block of a token-id sequence, given what precedes it.

A block's key is a hash of its parent's key and its own token ids, as vLLM's block hash
is, but computed the same way by every pdclient process and without vLLM's hash seed
(``PYTHONHASHSEED``, ``--prefix-caching-hash-algo``): the index keys the blocks a server
announces by these, and a conversation's known ids name its prefix with them. 8 bytes a
block (``pack``), so a 32k-token prefix in 128-token blocks is 2 KB.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = 0
"""The parent key of a sequence's first block."""

_KEY_BYTES = 8


def block_key(parent: int, token_ids: Sequence[int]) -> int:
    """The key of one block of ``token_ids`` after the block keyed ``parent``."""
    digest = hashlib.blake2b(parent.to_bytes(_KEY_BYTES, "little"), digest_size=_KEY_BYTES)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The keys of ``token_ids``' whole blocks, in order (a partial last block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def pack(keys: Sequence[int]) -> bytes:
    """Keys as bytes, 8 a key (what a memory keeps)."""
    return array("Q", keys).tobytes()


def unpack(packed: bytes) -> list[int]:
    keys = array("Q")
    keys.frombytes(packed)
    return keys.tolist()
