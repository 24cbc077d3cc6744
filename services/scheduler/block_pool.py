"""`BlockPool`: the scheduler's view of the executor's physical KV blocks.

Every block is in exactly one of three states:

    used    ref_cnt > 0                      held by one or more requests' block tables
    cached  ref_cnt == 0, block_hash set     free, but still holds a reusable full prefix block
    empty   ref_cnt == 0, no block_hash      free, holds nothing of value

Free blocks (cached and empty) sit in one queue, in eviction order: empty blocks at the front,
then cached blocks from least to most recently freed. Allocation takes from the front, so a
cached block is evicted only when no empty block is left, and then in LRU order.
A cache hit on a free cached block takes it out of the queue again ("touch").
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable

# Opaque to the pool; the KV cache manager uses `request.BlockHash` (sha256 digests).
BlockHash = Hashable


class NoFreeBlocksError(RuntimeError):
    pass


class CacheEvents:
    """What the prefix cache stored and dropped since the last `take`, for the KV events an
    engine replica publishes (schemas/routing.py). Each block's last change only: stored then
    dropped within one interval is dropped."""

    def __init__(self) -> None:
        self.changes: dict[BlockHash, bool] = {}  # hash -> cached now
        self.cleared = False  # every cached block went (reset): what came before is void

    def take(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """-> (stored, removed, cleared before them), and start over."""
        stored = [h for h, cached in self.changes.items() if cached]
        removed = [h for h, cached in self.changes.items() if not cached]
        cleared, self.changes, self.cleared = self.cleared, {}, False
        return stored, removed, cleared


class KVBlock:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full, hashed prefix block (until evicted).
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block_hash -> block_id
        self.num_evictions = 0
        self.events: CacheEvents | None = None  # set by a replica that publishes KV events

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds (a KV-event snapshot)."""
        return list(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a hashed prefix block, used or free."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue (evicting cached ones), ref_cnt 1."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones off the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        A block whose last reference goes returns to the queue: to the back (most recently used)
        when it holds a cached prefix, to the front when it holds nothing reusable.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> int | None:
        """The block holding exactly this prefix block, or None. Hash hits are confirmed by
        comparing the parent hash and the token ids, so a hash collision is only a miss."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block_id

    def cache_block(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> None:
        """Register a used, now full block under its chained hash.

        NOTE: when another block already holds the same prefix (two requests computed it in the
        same step), the first stays registered and this one remains an ordinary block.
        """
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.changes[block_hash] = True

    def uncache(self, block_id: int) -> None:
        """Drop a used block's prefix registration (its K/V will never be computed)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            assert block.ref_cnt > 0
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.changes[block.block_hash] = False
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def reset(self) -> None:
        """Back to the state of a new pool: every block free and empty, in id order. Only while
        no block is used."""
        assert all(block.ref_cnt == 0 for block in self.blocks), "reset of a pool in use"
        for block in self.blocks:
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self._cached.clear()
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        if self.events is not None:
            self.events.changes.clear()
            self.events.cleared = True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.changes[block.block_hash] = False
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self.num_evictions += 1

    def check_integrity(self, references: Counter[int]) -> None:
        """Assert the pool's invariants; `references` counts each block in all block tables."""
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
        for block in self.blocks:
            assert block.ref_cnt == references.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {references.get(block.block_id, 0)}"
            )
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"block {block.block_id}"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
        assert all(self.blocks[b].block_hash == h for h, b in self._cached.items())
        # Empty blocks precede cached ones in the free queue.
        seen_cached = False
        for block_id in self._free:
            is_cached = self.blocks[block_id].block_hash is not None
            assert not (seen_cached and not is_cached), "empty block behind a cached one"
            seen_cached = seen_cached or is_cached
