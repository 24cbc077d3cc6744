"""`KVCacheManager`: per-request block tables over the `BlockPool`, with automatic prefix caching.

A request's block table only grows while it holds blocks: block i stores the KV of its tokens
`[i * block_size, (i + 1) * block_size)`. Blocks are allocated on demand as tokens are
scheduled, so at most one partly filled block per request is waste. Every block that becomes
full is registered under its chained hash, so a later request with the same prefix shares it.

    block_table:  [ 7 ][ 2 ][ 9 ][ 4 ]      block_size = 4, num_tokens = 14
                   full full full part      three hashed blocks, 2 slots unused
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from parkade.services.scheduler.block_pool import BlockPool
from parkade.services.scheduler.request import BlockHash, Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        # How many leading blocks of each table have been offered to the prefix cache.
        self._num_hashed_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0  # tokens looked up, for the hit rate
        self.num_prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def match_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks: (block ids, num tokens).

        At least one token is always left to compute, because the executor needs a token's
        hidden state to sample the next one.
        """
        assert request.request_id not in self.block_tables
        if not self.enable_caching:
            return [], 0
        hashes = request.update_block_hashes()
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits: list[int] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes[i], parent, request.block_token_ids(i))
            if block_id is None:
                break
            hits.append(block_id)
            parent = hashes[i]
        return hits, len(hits) * self.block_size

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup toward the hit rate (not retries)."""
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
        num_reserved_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `computed_block_ids` are prefix-cache hits from `match_prefix` (a first admission only);
        `num_reserved_tokens` asks for slots beyond those (the `reserve` admission mode).
        Returns the newly allocated block ids, or None, changing nothing, when the pool is
        short of blocks.
        """
        table = self.block_tables.get(request.request_id)
        if table is not None and not computed_block_ids and not num_reserved_tokens:
            # The decode fast path: the request's last block usually has room for its next token.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(table) * self.block_size:
                if self.enable_caching and end // self.block_size > self._num_hashed_blocks.get(
                    request.request_id, 0
                ):
                    self._cache_full_blocks(request, table, end)
                return []
        if table is None:
            table = []
        num_computed = request.num_computed_tokens + len(computed_block_ids) * self.block_size
        num_total = num_computed + num_new_tokens + num_reserved_tokens
        num_needed = max(0, cdiv(num_total, self.block_size) - len(table) - len(computed_block_ids))
        # A hit on a free cached block takes that block out of the free queue too.
        num_free_hits = sum(1 for b in computed_block_ids if self.pool.blocks[b].ref_cnt == 0)
        if num_needed + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_block_ids)
        table.extend(computed_block_ids)
        new_block_ids = self.pool.allocate(num_needed)
        table.extend(new_block_ids)
        self.block_tables[request.request_id] = table
        self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        return new_block_ids

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Register the blocks that `num_tokens` tokens (once computed) fill completely.

        NOTE: a block is registered when it is scheduled, before the step computes it, so that
        requests admitted in the same step share it: every layer of the forward pass writes the
        step's K/V before it reads any. A request preempted before its step ran must therefore
        drop those registrations (`free(..., num_computed_tokens)`).
        """
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes()
        for i in range(start, num_full):
            parent = hashes[i - 1] if i > 0 else None
            self.pool.cache_block(table[i], hashes[i], parent, request.block_token_ids(i))
        self._num_hashed_blocks[request.request_id] = num_full

    def free(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Return a request's blocks. Idempotent.

        `num_computed_tokens`: only that many tokens' K/V was (or will be) written, so blocks
        past them lose their prefix-cache registration. Freed in reverse order, so that a
        request's tail blocks (the least likely to be shared) are evicted before its head.
        """
        table = self.block_tables.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        if not table:
            return
        if num_computed_tokens is not None:
            for block_id in table[num_computed_tokens // self.block_size :]:
                self.pool.uncache(block_id)
        self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        """free + used = total, and every block's ref_cnt equals its block-table references."""
        references: Counter[int] = Counter()
        for request_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice"
            references.update(table)
        self.pool.check_integrity(references)
