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
    # One conversion of all the ids, then a hash per block over a view of its bytes.
    data = memoryview(array("q", token_ids).tobytes())
    step = 8 * block_size
    keys: list[int] = []
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - step + 1, step):
        digest = blake2b(parent.to_bytes(_KEY_BYTES, "little"), digest_size=_KEY_BYTES)
        digest.update(data[start : start + step])
        parent = int.from_bytes(digest.digest(), "little")
        keys.append(parent)
    return keys


def pack(keys: Sequence[int]) -> bytes:
    """Keys as bytes, 8 a key (what a memory keeps)."""
    return array("Q", keys).tobytes()


def unpack(packed: bytes) -> list[int]:
    keys = array("Q")
    keys.frombytes(packed)
    return keys.tolist()


def turn_keys(prompt_ids: Sequence[int], answer_ids: Sequence[int], block_size: int) -> bytes:
    """A conversation turn's blocks, packed: its prompt's ids, then its answer's but the last.

    The decode sampled the answer's last id and never computed its KV, so no server holds
    a block that ends with it."""
    return pack(chain_keys([*prompt_ids, *answer_ids[:-1]], block_size))
