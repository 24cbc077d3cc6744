from parkade.schemas import EngineRequest, SamplingParams
from parkade.services.scheduler.kv_cache_manager import KVCacheManager
from parkade.services.scheduler.request import Request

BS = 4


def make(request_id: str, tokens: list[int]) -> Request:
    return Request(
        EngineRequest(
            request_id=request_id, prompt_token_ids=tuple(tokens), sampling_params=SamplingParams()
        ),
        BS,
    )


def test_blocks_are_allocated_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make("a", list(range(10)))
    assert kv.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    assert not kv.allocate_slots(r, 2)  # still fits in block 1: no new block
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 2) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.check_integrity()
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_identical_prefix_shares_physical_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    b = make("b", [*range(8), 99, 98, 97])
    hits, num_hit = kv.match_prefix(b)
    assert (hits, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 3, hits) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[2].ref_cnt == 1
    kv.check_integrity()


def test_a_fully_cached_prompt_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = make("b", list(range(8)))
    hits, num_hit = kv.match_prefix(b)
    assert (hits, num_hit) == ([0], 4)  # not both blocks: the last token must be computed


def test_freed_cached_blocks_are_hits_until_evicted():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make("a", list(range(9)))
    assert kv.allocate_slots(a, 9) == [0, 1, 2]
    kv.free(a)  # blocks 0 and 1 are cached; block 2 (partial) is empty
    b = make("b", [50] * 5)
    assert kv.allocate_slots(b, 5) == [2, 1]  # the empty block, then the LRU cached block (the tail)
    c = make("c", list(range(9)))
    assert kv.match_prefix(c) == ([0], 4)
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("a") == []
    kv.check_integrity()


def test_reserved_tokens_allocate_ahead():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make("a", list(range(3)))
    assert kv.allocate_slots(a, 3, num_reserved_tokens=10) == [0, 1, 2, 3]
    a.num_computed_tokens = 3
    assert not kv.allocate_slots(a, 1)  # reserved ahead: no new block


def test_without_caching_nothing_matches():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make("a", list(range(10)))
    kv.allocate_slots(a, 10)
    assert kv.match_prefix(make("b", list(range(10)))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


def test_only_scheduled_full_blocks_are_registered_and_uncomputed_ones_leave_on_free():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make("a", list(range(12)))
    kv.allocate_slots(a, 6)  # a chunk of 6 tokens: only block 0 is full
    assert kv.pool.num_cached_blocks == 1
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 6)
    assert kv.pool.num_cached_blocks == 3
    kv.free(a, num_computed_tokens=6)  # preempted before the second chunk ran
    assert kv.pool.num_cached_blocks == 1
    assert kv.match_prefix(make("b", list(range(12)))) == ([0], 4)
    kv.check_integrity()
