"""The index a vLLM worker rebuilds from vLLM's KV events, under Tandem's chain hash (no vLLM needed)."""

from __future__ import annotations

from tandem.engine.block_pool import FREE, HELD, REMOVED
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.vllm_engine.prefix_index import VllmPrefixIndex
from router_svc.prefix_index import PrefixIndex, PromptBlocks
from tandem.worker.servicer import _prefix_cache_messages

SIZE = 4


def stored(index: VllmPrefixIndex, tokens: list[int], first_vllm_hash: int = 1000, parent=None) -> list[int]:
    """Store ``tokens``' full blocks as vLLM announces them (one event, vLLM hashes counting up)."""
    vllm_hashes = list(range(first_vllm_hash, first_vllm_hash + len(tokens) // SIZE))
    assert index.store(parent, vllm_hashes, tokens[:len(vllm_hashes) * SIZE]) == len(vllm_hashes)
    return vllm_hashes


def test_blocks_are_rehashed_as_tandems_own_cache_hashes_them():
    tokens = list(range(10, 22))  # three blocks
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    stored(index, tokens)
    manager = KVCacheManager(16, SIZE)
    request = Request("r", tokens + [1], 1)
    manager.get_computed_blocks(request)
    feed = index.subscribe()
    reset, listing = index.take_changes(feed)
    assert reset and set(listing) == set(request.block_hashes[:3]) and set(listing.values()) == {FREE}


def test_a_chain_continues_from_its_parents_vllm_hash():
    tokens = list(range(40, 56))
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    first = stored(index, tokens[:8])
    stored(index, tokens[8:], first_vllm_hash=2000, parent=first[-1])
    assert index.cached_prefix(tokens + [1]).tokens == 16
    assert index.store(999_999, [3000], tokens[:4]) == 0  # an unknown parent: nothing to chain to


def test_a_lookup_stops_at_the_first_missing_block_and_leaves_one_token_to_compute():
    tokens = list(range(12))
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    vllm_hashes = stored(index, tokens)
    assert index.cached_prefix(tokens).tokens == 8  # 12 tokens: a full hit is capped to leave one
    assert index.cached_prefix(tokens + [99]).tokens == 12
    index.remove([vllm_hashes[1]])
    assert index.cached_prefix(tokens + [99]).tokens == 4


def test_a_running_requests_prompt_holds_its_blocks_until_it_ends():
    tokens = list(range(8))
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    stored(index, tokens)
    feed = index.subscribe()
    index.take_changes(feed)
    hashes = index.prompt_hashes(tokens)
    index.hold(hashes)
    assert index.cached_prefix(tokens + [1]).evictable_tokens == 0 and index.num_cached_free_blocks == 0
    assert index.take_changes(feed) == (False, {h: HELD for h in hashes})
    index.release(hashes)
    assert index.cached_prefix(tokens + [1]).evictable_tokens == 8 and index.num_cached_free_blocks == 2
    assert index.take_changes(feed) == (False, {h: FREE for h in hashes})


def test_a_block_vllm_stored_twice_stays_until_both_copies_are_removed():
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    tokens = [1, 2, 3, 4]
    stored(index, tokens)
    stored(index, tokens)
    index.remove([1000])
    assert index.cached_prefix(tokens + [5]).tokens == 4
    index.remove([1000])
    assert index.cached_prefix(tokens + [5]).tokens == 0
    index.remove([1000])  # an unknown hash: nothing happens


def test_clearing_removes_every_hash_for_the_followers():
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    stored(index, list(range(8)))
    feed = index.subscribe()
    _, listing = index.take_changes(feed)
    index.clear()
    assert index.take_changes(feed) == (False, {h: REMOVED for h in listing})
    assert len(index) == 0


def test_the_routers_copy_answers_lookups_as_the_index_does():
    tokens = list(range(100, 120))
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    stored(index, tokens[:12])
    copy = PrefixIndex()
    for message in _prefix_cache_messages(*index.take_changes(index.subscribe())):
        copy.apply(message)
    cached = index.cached_prefix(tokens)
    assert copy.cached(PromptBlocks(tokens), SIZE) == (cached.tokens, cached.evictable_tokens) == (12, 12)


def test_a_feed_that_stops_reading_gets_the_whole_index_again():
    index = VllmPrefixIndex(SIZE, feed_limit=2)
    feed = index.subscribe()
    index.take_changes(feed)
    stored(index, list(range(12)))
    reset, listing = index.take_changes(feed)
    assert reset and len(listing) == 3


def test_a_block_stored_while_a_running_prompt_covers_it_counts_as_held():
    tokens = list(range(8))
    index = VllmPrefixIndex(SIZE, feed_limit=100)
    index.hold(index.prompt_hashes(tokens))
    stored(index, tokens)
    assert (len(index), index.num_cached_free_blocks) == (2, 0)
    index.remove([1000, 1001])
    index.release(index.prompt_hashes(tokens))
    assert (len(index), index.num_cached_free_blocks) == (0, 0)
