"""The prefix cache's hash index followed from outside: the block pool's feeds, the worker's WatchState
messages made of them, and the router's index built from those messages."""

from __future__ import annotations

import random

from router_svc.prefix_index import EXPECTED_HIT_TTL_S, PrefixIndex, PromptBlocks
from tandem.engine.block_pool import FREE, HELD, REMOVED, BlockPool
from tandem.prefix_hash import extend_block_hashes, max_cache_hit_blocks
from tandem.v1 import common_pb2
from tandem.worker.servicer import _prefix_cache_messages

BLOCK = 4


def admit(pool: BlockPool, tokens: list[int]) -> list[int] | None:
    """What the KV cache manager does for a prompt: take its cached blocks, allocate the rest, publish the
    full ones. Returns the block ids held, or None when too few blocks are free."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, max_cache_hit_blocks(len(tokens), BLOCK))
    hits = pool.find_cached_blocks(hashes, tokens)
    needed = -(-len(tokens) // BLOCK) - len(hits)
    if needed > pool.num_reclaimable(hits):
        return None
    pool.touch(hits)
    block_ids = [block.block_id for block in hits] + pool.allocate(needed)
    extend_block_hashes(hashes, tokens, BLOCK, len(tokens) // BLOCK)
    for index in range(len(hits), len(tokens) // BLOCK):
        pool.cache_block(block_ids[index], hashes[index], tokens[index * BLOCK:(index + 1) * BLOCK])
    return block_ids


def sync(index: PrefixIndex, pool: BlockPool, feed, limit: int = 65536) -> None:
    for message in _prefix_cache_messages(*pool.take_changes(feed), limit=limit):
        index.apply(message)


def test_a_feed_lists_the_whole_index_first_then_only_what_changed():
    pool = BlockPool(8, BLOCK)
    first = admit(pool, list(range(9)))  # two full blocks published, held
    pool.free(first)
    second = admit(pool, [50, 51, 52, 53, 54])  # one full block, held
    feed = pool.subscribe()

    reset, listing = pool.take_changes(feed)
    assert reset
    assert sorted(listing.values()) == [FREE, FREE, HELD]
    assert pool.take_changes(feed) == (False, {})

    pool.free(second)
    reset, changes = pool.take_changes(feed)
    assert not reset and list(changes.values()) == [FREE]
    pool.allocate(8)  # evicts all three
    reset, changes = pool.take_changes(feed)
    assert not reset and sorted(changes.values()) == [REMOVED] * 3


def test_a_feed_that_stops_reading_falls_back_to_a_whole_listing_and_an_unsubscribed_one_gets_nothing():
    pool = BlockPool(2, BLOCK)
    feed, gone = pool.subscribe(), pool.subscribe()
    pool.take_changes(feed)
    pool.take_changes(gone)
    pool.unsubscribe(gone)
    for round_ in range(1100):  # every round publishes a new hash and evicts the previous one
        pool.free(admit(pool, [round_] * 5))
    assert not gone.changes
    reset, listing = pool.take_changes(feed)
    assert reset and len(listing) == 1


def test_the_index_built_from_the_messages_answers_as_the_pool_does_under_random_traffic():
    rng = random.Random(7)
    pool = BlockPool(40, BLOCK)
    feed = pool.subscribe()
    index = PrefixIndex()
    assert not index.synced
    blocks = [[rng.randrange(1000) for _ in range(BLOCK)] for _ in range(6)]

    def prompt() -> list[int]:  # a few shared blocks, so that prefixes overlap, and a ragged tail
        tokens = [t for _ in range(rng.randint(0, 5)) for t in rng.choice(blocks[:3] if rng.random() < 0.5 else blocks)]
        return tokens + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]

    held: list[list[int]] = []
    compared = 0
    for step in range(1500):
        if rng.random() < 0.55 or not held:
            block_ids = admit(pool, prompt())
            if block_ids is not None:
                held.append(block_ids)
        else:
            pool.free(held.pop(rng.randrange(len(held))))
        if step % 3 == 0:
            sync(index, pool, feed, limit=rng.choice([1, 2, 65536]))
            assert index.synced
            for _ in range(5):
                tokens = prompt()
                expected = pool.cached_prefix(tokens)
                assert index.cached(PromptBlocks(tokens), BLOCK) == (expected.tokens, expected.evictable_tokens)
                compared += expected.tokens > 0
    assert compared > 100, "the traffic should give many prefix hits to compare"


def test_a_split_listing_syncs_the_index_only_at_its_last_part_and_a_reset_starts_over():
    pool = BlockPool(8, BLOCK)
    pool.free(admit(pool, list(range(13))))  # three cached blocks
    parts = _prefix_cache_messages(*pool.take_changes(pool.subscribe()), limit=2)
    assert [(p.reset, p.continued) for p in parts] == [(True, True), (False, False)]
    index = PrefixIndex()
    index.apply(parts[0])
    assert not index.synced
    index.apply(parts[1])
    assert index.synced and len(index) == 3
    assert index.cached(PromptBlocks(list(range(14))), BLOCK) == (12, 12)

    index.apply(_prefix_cache_messages(True, {})[0])  # a new whole listing, of an empty cache
    assert index.synced and len(index) == 0
    index.forget()
    assert not index.synced


def test_prompt_blocks_hash_once_per_block_size_and_leave_one_token_to_compute():
    tokens = list(range(17))
    prompt = PromptBlocks(tokens)
    assert len(prompt.hashes(4)) == 4 and len(prompt.hashes(8)) == 2 and len(prompt.hashes(16)) == 1
    assert prompt.hashes(4) is prompt.hashes(4)
    assert PromptBlocks(tokens[:16]).hashes(4) == prompt.hashes(4)[:3]


def test_a_prompt_just_sent_counts_as_held_until_the_worker_confirms_or_evicts_it():
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    index.apply(common_pb2.PrefixCacheChanges(reset=True))
    prompt = PromptBlocks(list(range(33)))  # two full blocks of 16 a hit may cover
    first, second = prompt.hashes(16)
    assert index.cached(prompt, 16) == (0, 0)
    index.expect(prompt, 16)
    assert index.cached(prompt, 16) == (32, 0)
    assert index.cached(PromptBlocks(list(range(33))), 8) == (0, 0)  # expected at the worker's block size only
    index.apply(common_pb2.PrefixCacheChanges(free=[first]))  # confirmed, and free by now
    assert index.cached(prompt, 16) == (32, 16)
    index.apply(common_pb2.PrefixCacheChanges(removed=[second]))  # evicted before it was ever reported held
    assert index.cached(prompt, 16) == (16, 16)


def test_an_expected_hit_lapses_when_the_worker_never_reports_it():
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0])
    index.apply(common_pb2.PrefixCacheChanges(reset=True))
    prompt = PromptBlocks(list(range(17)))
    index.expect(prompt, 16)
    now[0] = EXPECTED_HIT_TTL_S - 1
    assert index.cached(prompt, 16) == (16, 0)
    now[0] = EXPECTED_HIT_TTL_S + 1
    assert index.cached(prompt, 16) == (0, 0)
    index.expect(prompt, 16)
    index.forget()  # the stream that fed the index ended: nothing is known
    assert index.cached(prompt, 16) == (0, 0)
