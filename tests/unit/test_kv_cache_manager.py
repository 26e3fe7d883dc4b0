"""Unit tests for the KV cache manager: computed blocks, slots, publishing, freeing and queue estimates."""

from __future__ import annotations

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request

BLOCK = 4


def make_request(req_id: str, prompt, max_new_tokens: int = 4) -> Request:
    return Request(req_id, list(prompt), max_new_tokens)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> bool:
    """Admit ``request`` as the scheduler does and, on success, compute its new tokens."""
    computed_blocks = manager.get_computed_blocks(request)
    num_cached = len(computed_blocks) * BLOCK
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_cached
    if not manager.admit(request, computed_blocks, num_new_tokens):
        return False
    request.num_computed_tokens = num_cached + num_new_tokens
    manager.cache_blocks(request)
    return True


def compute(manager: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """One more step of a running request: slots for ``num_new_tokens``, then publish what they filled."""
    assert request.num_computed_tokens + num_new_tokens <= request.num_tokens
    assert manager.allocate_slots(request, num_new_tokens)
    request.num_computed_tokens += num_new_tokens
    manager.cache_blocks(request)


def warm(manager: KVCacheManager, prompt) -> list[int]:
    """Compute ``prompt`` once and free it, leaving its full blocks cached; returns the blocks it held."""
    request = make_request("warm", prompt)
    assert admit(manager, request)
    block_ids = list(request.block_ids)
    manager.free(request)
    return block_ids


# --- computed blocks -----------------------------------------------------------------------------


def test_computed_blocks_are_the_cached_prefix_and_are_not_taken():
    manager = KVCacheManager(8, BLOCK)
    warmed = warm(manager, range(10))
    request = make_request("r", list(range(8)) + [99])
    hits = manager.get_computed_blocks(request)
    assert [block.block_id for block in hits] == warmed[:2]
    assert all(block.ref_count == 0 for block in hits)
    assert manager.block_pool.num_free_blocks == 8
    assert manager.cached_prefix(request.token_ids).tokens == 8


def test_a_full_hit_leaves_one_token_to_compute():
    manager = KVCacheManager(8, BLOCK)
    warm(manager, range(8))
    assert len(manager.get_computed_blocks(make_request("same", range(8)))) == 1


# --- admission -----------------------------------------------------------------------------------


def test_admit_takes_the_computed_blocks_and_allocates_the_rest():
    manager = KVCacheManager(8, BLOCK)
    warmed = warm(manager, range(10))
    request = make_request("r", list(range(8)) + [99])
    assert admit(manager, request)
    assert request.block_ids[:2] == warmed[:2]
    assert len(request.block_ids) == 3
    assert [manager.block_pool.blocks[i].ref_count for i in request.block_ids] == [1, 1, 1]
    assert request.num_published_blocks == 2
    assert (manager.block_pool.num_queried_tokens, manager.block_pool.num_hit_tokens) == (10 + 9, 8)


def test_admit_changes_nothing_when_too_few_blocks_are_free():
    manager = KVCacheManager(3, BLOCK)
    holder = make_request("holder", range(100, 108))
    assert admit(manager, holder)
    waiter = make_request("waiter", range(9))  # needs 3 blocks, 1 is free
    manager.estimate_cache(waiter)
    assert not admit(manager, waiter)
    assert waiter.block_ids == []
    assert manager.block_pool.num_used_blocks == 2
    assert manager.block_pool.num_queried_tokens == 8
    assert waiter.num_cached_estimate == 0


def test_a_chunk_is_given_blocks_for_its_tokens_only():
    manager = KVCacheManager(8, BLOCK)
    request = make_request("long", range(20))
    assert admit(manager, request, num_new_tokens=6)
    assert len(request.block_ids) == 2
    assert request.num_computed_tokens == 6


# --- growth --------------------------------------------------------------------------------------


def test_allocate_slots_adds_a_block_only_when_the_last_one_is_full():
    manager = KVCacheManager(4, BLOCK)
    request = make_request("r", [1, 2, 3], max_new_tokens=8)
    assert admit(manager, request)
    assert len(request.block_ids) == 1
    request.token_ids.append(10)
    compute(manager, request, 1)  # the 4th token fills the first block
    assert len(request.block_ids) == 1
    request.token_ids.append(11)
    compute(manager, request, 1)
    assert len(request.block_ids) == 2
    assert manager.block_pool.num_used_blocks == 2


def test_allocate_slots_changes_nothing_when_no_block_is_free():
    manager = KVCacheManager(1, BLOCK)
    request = make_request("r", [1, 2, 3, 4])
    assert admit(manager, request)
    block_ids = list(request.block_ids)
    assert not manager.allocate_slots(request, 1)
    assert request.block_ids == block_ids
    assert manager.block_pool.num_used_blocks == 1


# --- publishing ----------------------------------------------------------------------------------


def test_cache_blocks_publishes_each_full_computed_block_once():
    manager = KVCacheManager(4, BLOCK)
    prompt = list(range(10))
    request = make_request("r", prompt)
    assert admit(manager, request, num_new_tokens=6)
    assert request.num_published_blocks == 1
    assert manager.cached_prefix(prompt).tokens == 4
    compute(manager, request, 4)
    assert request.num_published_blocks == 2
    assert manager.cached_prefix(prompt).tokens == 8
    hashes = [manager.block_pool.blocks[i].block_hash for i in request.block_ids]
    manager.cache_blocks(request)
    assert [manager.block_pool.blocks[i].block_hash for i in request.block_ids] == hashes
    assert hashes[2] is None, "a partly filled block is never published"


# --- freeing -------------------------------------------------------------------------------------


def test_free_releases_every_block_tail_first():
    manager = KVCacheManager(4, BLOCK)
    prompt = list(range(13))
    request = make_request("r", prompt)
    assert admit(manager, request)
    manager.free(request)
    assert request.block_ids == [] and request.num_published_blocks == 0
    assert manager.block_pool.num_used_blocks == 0
    observed = []
    for _ in range(4):
        manager.block_pool.allocate(1)
        observed.append(manager.cached_prefix(prompt).tokens)
    # The unpublished tail block goes first, then the published blocks from the last one back.
    assert observed == [12, 8, 4, 0]


def test_reset_prefix_cache_forgets_every_cached_block():
    manager = KVCacheManager(4, BLOCK)
    warm(manager, range(9))
    manager.reset_prefix_cache()
    assert manager.cached_prefix(list(range(9))).tokens == 0
    assert manager.block_pool.num_cached_free_blocks == 0


# --- queue estimates -----------------------------------------------------------------------------


def test_estimate_shrinks_when_a_counted_block_is_evicted():
    manager = KVCacheManager(4, BLOCK)
    warm(manager, range(9))  # 2 cached blocks; the free queue evicts the second before the first
    waiter = make_request("waiter", list(range(8)) + [50])
    manager.estimate_cache(waiter)
    assert waiter.num_cached_estimate == 8

    observed = []
    for _ in range(4):
        manager.block_pool.allocate(1)
        observed.append(waiter.num_cached_estimate)
    assert observed == [8, 8, 4, 0]


def test_admission_drops_the_estimate():
    manager = KVCacheManager(8, BLOCK)
    warm(manager, range(9))
    waiter = make_request("waiter", list(range(8)) + [50])
    manager.estimate_cache(waiter)
    assert waiter.cache_estimate_hashes
    assert admit(manager, waiter)
    assert waiter.cache_estimate_hashes == []


def test_a_freed_waiting_request_keeps_its_last_estimate_through_evictions():
    manager = KVCacheManager(4, BLOCK)
    warm(manager, range(9))
    waiter = make_request("waiter", list(range(8)) + [50])
    manager.estimate_cache(waiter)
    manager.free(waiter)
    assert manager.block_pool.allocate(4) is not None  # evicts both blocks it had counted on
    assert waiter.num_cached_estimate == 8
    assert manager.cached_prefix(waiter.token_ids).tokens == 0


def test_estimates_of_several_waiting_requests_are_corrected_independently():
    manager = KVCacheManager(4, BLOCK)
    warm(manager, range(9))
    long = make_request("long", list(range(8)) + [50])
    short = make_request("short", list(range(4)) + [60])
    manager.estimate_cache(long)
    manager.estimate_cache(short)
    assert (long.num_cached_estimate, short.num_cached_estimate) == (8, 4)
    manager.block_pool.allocate(3)  # the tail block, an empty one, then the second cached block
    assert (long.num_cached_estimate, short.num_cached_estimate) == (4, 4)
    manager.block_pool.allocate(1)
    assert (long.num_cached_estimate, short.num_cached_estimate) == (0, 0)
