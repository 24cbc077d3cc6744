"""The chained block hash: what identifies a prefix block, for the scheduler's prefix cache and
for the routers that guess which replica caches what (one function for both, so they agree).
"""

from __future__ import annotations

import hashlib
from array import array

from parkade.schemas.routing import short_hash

# A chained block hash: it identifies the whole prefix up to the end of its block.
BlockHash = bytes


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent hash of a request's first block: None without a salt, so that unsalted
    requests share with each other; a salt's own digest otherwise, so that two salts never meet
    (the first block's hash and its confirmed parent both differ)."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"parkade-cache-salt\0" + cache_salt.encode()).digest()


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """sha256(parent hash + the block's token ids).

    NOTE: a cryptographic hash rather than Python's `hash`: with a predictable 64-bit hash a
    client could craft two prefixes whose parents collide and read another request's KV. A hit is
    also confirmed by comparing the parent hash and the token ids.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


# A reference block: a router hashes it and compares with each replica's `hash_check`.
HASH_CHECK_TOKENS = tuple(range(16))


def hash_check() -> int:
    return short_hash(hash_block(None, HASH_CHECK_TOKENS))
