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
from parkade.services.scheduler.request import BlockHash, Request, hash_block

_NO_BLOCKS: tuple[int, ...] = ()  # what a step that needs no new block gets


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # request_id -> block table. The same list is the request's `block_ids`; the request's
        # `num_hashed_blocks` counts its leading blocks offered to the prefix cache, and
        # `kv_noop_until` says up to which token count `allocate_slots` has nothing to do. The
        # manager owns these fields; they live on the request so that a decode step reads no dict.
        self.block_tables: dict[str, list[int]] = {}
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
        assert not request.block_ids
        # A request that wants prompt logprobs computes its whole prompt: a cached block has
        # K/V but no logits (vLLM's rule too).
        if not self.enable_caching or request.prompt_logprobs is not None:
            return [], 0
        hashes = request.update_block_hashes()
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits: list[int] = []
        parent: BlockHash | None = request.block_hash_root
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
    ) -> Sequence[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `computed_block_ids` are prefix-cache hits from `match_prefix` (a first admission only);
        `num_reserved_tokens` asks for slots beyond those (the `reserve` admission mode).
        Returns the newly allocated block ids, or None, changing nothing, when the pool is
        short of blocks.
        """
        if request.num_computed_tokens + num_new_tokens <= request.kv_noop_until and not (
            computed_block_ids or num_reserved_tokens
        ):
            return _NO_BLOCKS  # the decode fast path: the last block has room and fills no block
        if not (computed_block_ids or num_reserved_tokens):
            return self._grow(request, request.num_computed_tokens + num_new_tokens)
        table = request.block_ids
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
        if table:
            self.block_tables[request.request_id] = table
        self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        self._set_noop_until(request)
        return new_block_ids

    def _grow(self, request: Request, num_tokens: int) -> Sequence[int] | None:
        """`allocate_slots` without prefix hits or reservation (a decode that fills or needs a
        block, a prefill chunk): room for `num_tokens` tokens in all."""
        table = request.block_ids
        num_needed = cdiv(num_tokens, self.block_size) - len(table)
        if num_needed > 0:
            if num_needed > self.pool.num_free_blocks:
                return None
            new_block_ids = self.pool.allocate(num_needed)
            table.extend(new_block_ids)
            self.block_tables[request.request_id] = table  # (already there unless it was empty)
        else:
            new_block_ids = _NO_BLOCKS
        self._cache_full_blocks(request, table, num_tokens)
        self._set_noop_until(request)
        return new_block_ids

    def _set_noop_until(self, request: Request) -> None:
        """Up to which token count `allocate_slots` has nothing to do: the held slots, and with
        caching, short of filling the first block not yet offered to the prefix cache."""
        end = len(request.block_ids) * self.block_size
        if self.enable_caching:
            end = min(end, (request.num_hashed_blocks + 1) * self.block_size - 1)
        request.kv_noop_until = end

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
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        # Hash the blocks not hashed yet here, so that each block's token tuple is built once.
        # (len(hashes) >= start: a request hashes its blocks in order and never forgets one.)
        hashes = request.block_hashes
        for i in range(start, num_full):
            token_ids = request.block_token_ids(i)
            parent = hashes[i - 1] if i > 0 else request.block_hash_root
            if i == len(hashes):
                hashes.append(hash_block(parent, token_ids))
            self.pool.cache_block(table[i], hashes[i], parent, token_ids)
        request.num_hashed_blocks = num_full

    def free(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Return a request's blocks. Idempotent.

        `num_computed_tokens`: only that many tokens' K/V was (or will be) written, so blocks
        past them lose their prefix-cache registration. Freed in reverse order, so that a
        request's tail blocks (the least likely to be shared) are evicted before its head.
        """
        table = request.block_ids
        self.block_tables.pop(request.request_id, None)
        request.block_ids, request.num_hashed_blocks, request.kv_noop_until = [], 0, 0
        if not table:
            return
        if num_computed_tokens is not None:
            for block_id in table[num_computed_tokens // self.block_size :]:
                self.pool.uncache(block_id)
        self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False, changing nothing, while a request holds
        blocks (their registrations would go with K/V still in use). The counters stay."""
        if self.block_tables:
            return False
        self.pool.reset()
        return True

    def check_integrity(self) -> None:
        """free + used = total, and every block's ref_cnt equals its block-table references."""
        references: Counter[int] = Counter()
        for request_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice"
            references.update(table)
        self.pool.check_integrity(references)
