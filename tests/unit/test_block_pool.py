from collections import Counter

import pytest

from parkade.services.scheduler.block_pool import BlockPool, NoFreeBlocksError


def refs(pool: BlockPool, *tables: list[int]) -> Counter[int]:
    counter: Counter[int] = Counter()
    for table in tables:
        counter.update(table)
    return counter


def test_allocate_takes_lowest_ids_first_and_free_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.check_integrity(refs(pool, [0, 1, 2]))
    pool.free([2, 1, 0])
    assert pool.num_free_blocks == 4
    pool.check_integrity(Counter())
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)


def test_empty_blocks_are_reused_before_cached_ones_and_cached_ones_in_lru_order():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, 100, None, (1, 2))
    pool.cache_block(b, 200, 100, (3, 4))
    pool.free([b])  # cached, freed first: least recently used
    pool.free([a])  # cached
    pool.free([c])  # empty: goes to the front
    pool.check_integrity(refs(pool, [d]))
    assert pool.allocate(1) == [c]
    assert pool.num_cached_blocks == 2
    assert pool.allocate(1) == [b]  # LRU cached block is evicted first
    assert pool.num_cached_blocks == 1 and pool.num_evictions == 1
    assert pool.lookup(200, 100, (3, 4)) is None
    assert pool.lookup(100, None, (1, 2)) == a


def test_lookup_confirms_token_ids_and_parent():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7, None, (5, 6))
    assert pool.lookup(7, None, (5, 6)) == a
    assert pool.lookup(7, None, (5, 9)) is None  # a hash collision is a miss
    assert pool.lookup(7, 3, (5, 6)) is None


def test_touch_takes_a_free_cached_block_off_the_queue():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7, None, (5, 6))
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert pool.num_free_blocks == 1 and pool.blocks[a].ref_cnt == 1
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 2
    pool.check_integrity(refs(pool, [a], [a]))


def test_duplicate_prefix_keeps_first_block_registered():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 7, None, (5, 6))
    pool.cache_block(b, 7, None, (5, 6))
    assert pool.blocks[b].block_hash is None
    assert pool.lookup(7, None, (5, 6)) == a


def test_integrity_check_catches_a_wrong_ref_count():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity(Counter())
