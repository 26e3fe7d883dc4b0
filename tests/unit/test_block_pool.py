"""Unit tests for the paged KV block pool and its chain hashing."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block, max_cache_hit_blocks

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4


def chain(token_ids, block_size=BLOCK):
    """Chain hashes of every full block of ``token_ids``."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size)
    return hashes


def cache_sequence(pool: BlockPool, token_ids) -> list[int]:
    """Allocate blocks for the full blocks of ``token_ids``, publish them, and return their ids (still held)."""
    hashes = chain(token_ids, pool.block_size)
    block_ids = pool.allocate(len(hashes))
    assert block_ids is not None
    size = pool.block_size
    for index, (block_id, block_hash) in enumerate(zip(block_ids, hashes)):
        pool.cache_block(block_id, block_hash, token_ids[index * size:(index + 1) * size])
    return block_ids


class EvictionLog:
    def __init__(self):
        self.hashes: list[bytes] = []

    def __call__(self, block_hash: bytes) -> None:
        self.hashes.append(block_hash)


# --- hashing -----------------------------------------------------------------------------------


def test_root_hash_is_blake2b_of_fixed_seed():
    assert ROOT_HASH == hashlib.blake2b(b"tandem.kv.v1", digest_size=16).digest()
    assert len(ROOT_HASH) == 16


def test_hash_block_is_blake2b_of_parent_and_little_endian_int64_tokens():
    tokens = [1, 2, 3, 70000]
    expected = hashlib.blake2b(ROOT_HASH + struct.pack("<4q", *tokens), digest_size=16).digest()
    assert hash_block(ROOT_HASH, tokens) == expected


def test_hash_block_is_deterministic_and_sequence_type_agnostic():
    first = hash_block(ROOT_HASH, [5, 6, 7, 8])
    assert hash_block(ROOT_HASH, [5, 6, 7, 8]) == first
    assert hash_block(ROOT_HASH, (5, 6, 7, 8)) == first
    assert hash_block(ROOT_HASH, range(5, 9)) == first
    assert len(first) == 16


def test_hash_block_depends_on_parent_and_tokens():
    tokens = [9, 9, 9, 9]
    parent_a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    parent_b = hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert parent_a != parent_b
    assert hash_block(parent_a, tokens) != hash_block(parent_b, tokens)
    assert hash_block(ROOT_HASH, tokens) != hash_block(parent_a, tokens)
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [4, 3, 2, 1])


def test_hash_block_does_not_depend_on_python_hash_randomization():
    code = (
        "from tandem.prefix_hash import ROOT_HASH, hash_block;"
        "print(hash_block(hash_block(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    expected = hash_block(hash_block(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
        )
        assert result.stdout.strip() == expected


def test_extend_block_hashes_covers_full_blocks_up_to_limit():
    tokens = list(range(10))  # two full blocks of 4, two tokens left over
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, limit=5)
    assert hashes == [hash_block(ROOT_HASH, tokens[:4]), hash_block(hash_block(ROOT_HASH, tokens[:4]), tokens[4:8])]

    limited: list[bytes] = []
    extend_block_hashes(limited, tokens, BLOCK, limit=1)
    assert limited == hashes[:1]

    # Continues the chain from what is already there rather than restarting it.
    extend_block_hashes(limited, tokens, BLOCK, limit=2)
    assert limited == hashes


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)],
)
def test_max_cache_hit_blocks_leaves_one_token_to_compute(num_tokens, expected):
    assert max_cache_hit_blocks(num_tokens, BLOCK) == expected


# --- allocation and reference counting ---------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_pool_rejects_non_positive_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocate_takes_blocks_in_order_and_returns_none_when_too_few():
    pool = BlockPool(4, BLOCK)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 3
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1, "a failed allocation must not take any block"
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_touch_and_free_count_references():
    pool = BlockPool(2, BLOCK)
    [block_id] = pool.allocate(1)
    block = pool.blocks[block_id]
    assert block.ref_count == 1

    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block_id])
    assert block.ref_count == 1
    assert pool.num_used_blocks == 1, "a block still referenced must stay out of the free queue"
    pool.free([block_id])
    assert block.ref_count == 0
    assert pool.num_used_blocks == 0


def test_touch_takes_free_cached_block_out_of_free_queue():
    pool = BlockPool(3, BLOCK)
    tokens = [1, 2, 3, 4]
    [block_id] = cache_sequence(pool, tokens)
    pool.free([block_id])
    assert pool.num_free_blocks == 3

    hits = pool.find_cached_blocks(chain(tokens), tokens)
    assert pool.num_reclaimable(hits) == 2
    pool.touch(hits)
    assert pool.num_free_blocks == 2
    assert pool.blocks[block_id].ref_count == 1
    # The touched block is not handed out again.
    assert pool.allocate(3) is None
    assert block_id not in pool.allocate(2)


def test_freeing_more_often_than_taken_raises():
    pool = BlockPool(2, BLOCK)
    [block_id] = pool.allocate(1)
    pool.free([block_id])
    with pytest.raises(RuntimeError, match="freed more often than taken"):
        pool.free([block_id])


def test_num_reclaimable_only_counts_unreferenced_hits():
    pool = BlockPool(4, BLOCK)
    tokens = list(range(8))
    held = cache_sequence(pool, tokens)  # two blocks, both held
    pool.free([held[1]])  # second block becomes free but stays cached
    hits = pool.find_cached_blocks(chain(tokens), tokens)
    assert [b.block_id for b in hits] == held
    # Three blocks are free, but taking the free hit leaves two for allocation.
    assert pool.num_free_blocks == 3
    assert pool.num_reclaimable(hits) == 2


# --- eviction order ----------------------------------------------------------------------------


def test_cached_blocks_are_evicted_in_the_order_they_were_freed():
    log = EvictionLog()
    pool = BlockPool(4, BLOCK, on_evict=log)
    sequences = [[10 * i + j for j in range(BLOCK)] for i in range(4)]
    block_ids = [cache_sequence(pool, seq)[0] for seq in sequences]
    hashes = [chain(seq)[0] for seq in sequences]
    assert pool.num_cached_free_blocks == 0

    free_order = [2, 0, 3, 1]
    for index in free_order:
        pool.free([block_ids[index]])
    assert pool.num_cached_free_blocks == 4

    evicted_blocks = [pool.allocate(1)[0] for _ in range(4)]
    assert evicted_blocks == [block_ids[i] for i in free_order]
    assert log.hashes == [hashes[i] for i in free_order]
    assert pool.num_cached_free_blocks == 0


def test_unhashed_freed_blocks_are_reused_before_cached_ones():
    log = EvictionLog()
    pool = BlockPool(4, BLOCK, on_evict=log)
    cached = cache_sequence(pool, list(range(8)))  # blocks 0 and 1, published
    plain = pool.allocate(2)  # blocks 2 and 3, never published
    assert pool.num_free_blocks == 0

    pool.free(cached)
    pool.free(plain)  # freed after the cached ones, yet reused first
    first_two = pool.allocate(2)
    assert sorted(first_two) == sorted(plain)
    assert log.hashes == [], "no cached block may be evicted while unhashed ones are free"
    assert pool.num_cached_free_blocks == 2

    assert pool.allocate(2) == cached
    assert len(log.hashes) == 2


def test_on_evict_reports_the_evicted_hash_and_the_block_is_no_longer_found():
    log = EvictionLog()
    pool = BlockPool(1, BLOCK, on_evict=log)
    tokens = [7, 7, 7, 7]
    [block_id] = cache_sequence(pool, tokens)
    pool.free([block_id])
    assert pool.find_cached_blocks(chain(tokens), tokens) != []

    assert pool.allocate(1) == [block_id]
    assert log.hashes == [chain(tokens)[0]]
    assert pool.find_cached_blocks(chain(tokens), tokens) == []
    assert pool.blocks[block_id].block_hash is None
    assert pool.blocks[block_id].token_ids is None


def test_allocating_uncached_blocks_does_not_call_on_evict():
    log = EvictionLog()
    pool = BlockPool(3, BLOCK, on_evict=log)
    pool.free(pool.allocate(3))
    pool.allocate(3)
    assert log.hashes == []


# --- publishing and lookup ---------------------------------------------------------------------


def test_find_cached_blocks_returns_longest_matching_run():
    pool = BlockPool(8, BLOCK)
    tokens = list(range(12))
    held = cache_sequence(pool, tokens)
    hashes = chain(tokens)

    assert [b.block_id for b in pool.find_cached_blocks(hashes, tokens)] == held
    assert [b.block_id for b in pool.find_cached_blocks(hashes[:2], tokens)] == held[:2]

    # A different second block breaks the run there, even though the third position's tokens match.
    other = tokens[:4] + [99, 99, 99, 99] + tokens[8:]
    assert [b.block_id for b in pool.find_cached_blocks(chain(other), other)] == held[:1]
    assert pool.find_cached_blocks(chain([50, 51, 52, 53]), [50, 51, 52, 53]) == []


def test_find_cached_blocks_verifies_stored_tokens_on_a_hash_hit():
    pool = BlockPool(4, BLOCK)
    tokens = [1, 2, 3, 4]
    cache_sequence(pool, tokens)
    block_hash = chain(tokens)[0]
    assert pool.find_cached_blocks([block_hash], tokens) != []
    # Same hash, different tokens (as a collision would look): not a hit.
    assert pool.find_cached_blocks([block_hash], [1, 2, 3, 5]) == []


def test_cache_block_keeps_the_first_block_published_under_a_hash():
    pool = BlockPool(4, BLOCK)
    tokens = [4, 3, 2, 1]
    [first] = cache_sequence(pool, tokens)
    [second] = cache_sequence(pool, tokens)
    assert second != first
    assert pool.blocks[second].block_hash is None, "a duplicate publish must not claim the hash"
    [hit] = pool.find_cached_blocks(chain(tokens), tokens)
    assert hit.block_id == first


def test_cache_block_does_not_republish_a_hashed_block():
    pool = BlockPool(2, BLOCK)
    [block_id] = cache_sequence(pool, [1, 1, 1, 1])
    other = [2, 2, 2, 2]
    pool.cache_block(block_id, chain(other)[0], other)
    assert pool.find_cached_blocks(chain(other), other) == []
    assert pool.blocks[block_id].token_ids == (1, 1, 1, 1)


def test_cached_prefix_counts_as_evictable_only_the_blocks_no_request_holds():
    pool = BlockPool(8, BLOCK)
    tokens = list(range(100, 112))
    held = cache_sequence(pool, tokens)  # three full blocks, held
    assert (pool.cached_prefix(tokens + [1]).tokens, pool.cached_prefix(tokens + [1]).evictable_tokens) == (12, 0)
    pool.free(held[-1:])  # the last block is released but stays cached
    assert (pool.cached_prefix(tokens + [1]).tokens, pool.cached_prefix(tokens + [1]).evictable_tokens) == (12, 4)


def test_cached_prefix_caps_a_full_hit_so_one_token_is_computed():
    pool = BlockPool(8, BLOCK)
    tokens = list(range(100, 108))
    cache_sequence(pool, tokens)  # two full blocks

    assert pool.cached_prefix(tokens).tokens == 4
    assert pool.cached_prefix(tokens + [1]).tokens == 8
    assert pool.cached_prefix(tokens + [1, 2, 3, 4, 5]).tokens == 8
    assert pool.cached_prefix(tokens[:5]).tokens == 4
    assert pool.cached_prefix(tokens[:4]).tokens == 0
    assert pool.cached_prefix([]).tokens == 0
    assert pool.cached_prefix([0] + tokens).tokens == 0


def _pool_with_history(log: EvictionLog) -> BlockPool:
    """A pool with a mix of held, cached-free and plain free blocks."""
    pool = BlockPool(6, BLOCK, on_evict=log)
    cached = cache_sequence(pool, list(range(12)))
    assert pool.allocate(1) is not None  # stays held
    pool.free(list(reversed(cached)))
    pool.record_lookup(10, 4)
    return pool


def test_cached_prefix_len_has_no_side_effects():
    probed_log, reference_log = EvictionLog(), EvictionLog()
    probed = _pool_with_history(probed_log)
    reference = _pool_with_history(reference_log)

    assert probed.cached_prefix(list(range(13))).tokens == 12
    assert probed.cached_prefix(list(range(9))).tokens == 8

    assert probed.num_queried_tokens == reference.num_queried_tokens == 10
    assert probed.num_hit_tokens == reference.num_hit_tokens == 4
    assert probed.num_free_blocks == reference.num_free_blocks
    assert probed.num_cached_free_blocks == reference.num_cached_free_blocks == 3
    assert [b.ref_count for b in probed.blocks] == [b.ref_count for b in reference.blocks]
    # Same free-queue order: allocating everything gives the same blocks and evictions.
    assert probed.allocate(probed.num_free_blocks) == reference.allocate(reference.num_free_blocks)
    assert probed_log.hashes == reference_log.hashes


def test_record_lookup_accumulates_counters():
    pool = BlockPool(2, BLOCK)
    pool.record_lookup(10, 4)
    pool.record_lookup(6, 0)
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (16, 4)


# --- reset ---------------------------------------------------------------------------------------


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(4, BLOCK)
    held = cache_sequence(pool, list(range(8)))
    with pytest.raises(RuntimeError):
        pool.reset_prefix_cache()
    assert pool.cached_prefix(list(range(9))).tokens == 8, "a refused reset must leave the cache intact"
    pool.free(held)


def test_reset_prefix_cache_forgets_everything_once_idle():
    log = EvictionLog()
    pool = BlockPool(4, BLOCK, on_evict=log)
    tokens = list(range(8))
    pool.free(cache_sequence(pool, tokens))
    pool.record_lookup(8, 4)

    pool.reset_prefix_cache()
    assert sorted(log.hashes) == sorted(chain(tokens))
    assert pool.num_cached_free_blocks == 0
    assert pool.num_free_blocks == 4
    assert pool.cached_prefix(tokens + [0]).tokens == 0
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (0, 0)


def test_cached_free_counter_matches_a_full_count_under_random_operations():
    rng = random.Random(5)
    pool = BlockPool(num_blocks=24, block_size=4)
    held: list[list[int]] = []
    next_token = 0
    for _ in range(2000):
        action = rng.random()
        if action < 0.4:
            block_ids = pool.allocate(rng.randint(1, 4))
            if block_ids is not None:
                for block_id in block_ids:
                    if rng.random() < 0.7:
                        tokens = list(range(next_token, next_token + 4))
                        next_token += 4
                        pool.cache_block(block_id, hash_block(ROOT_HASH, tokens), tokens)
                held.append(block_ids)
        elif action < 0.7 and held:
            pool.free(list(reversed(held.pop(rng.randrange(len(held))))))
        else:
            cached = [b for b in pool.blocks if b.block_hash is not None]
            if cached:
                block = rng.choice(cached)
                pool.touch([block])
                held.append([block.block_id])
        brute = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
        assert pool.num_cached_free_blocks == brute
