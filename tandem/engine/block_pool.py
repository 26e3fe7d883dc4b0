"""Paged KV blocks with prefix reuse.

A full block is identified by its chain hash (``tandem.prefix_hash``). Blocks no request holds stay cached (still findable by hash) in an LRU free queue until they are reused.

Subscribers (a router, through the worker's WatchState) follow the hash index through ``CacheFeed``s:
each cached hash is ``HELD`` (some request holds its block), ``FREE`` (cached, evictable) or ``REMOVED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tandem.prefix_hash import extend_block_hashes, max_cache_hit_blocks

HELD, FREE, REMOVED = "held", "free", "removed"


class CacheFeed:
    """One subscriber's pending changes to the hash index: the newest standing of each hash changed since
    it last took them. A stale feed (new, or fallen too far behind) gets the whole index next instead."""

    __slots__ = ("changes", "stale")

    def __init__(self):
        self.changes: dict[bytes, str] = {}
        self.stale = True


class CacheFeeds:
    """The subscribers of one hash index, and what each has still to take.

    Args:
        limit: changes a feed may pile up before it turns stale (a subscriber that stopped reading).
    """

    def __init__(self, limit: int):
        self._feeds: list[CacheFeed] = []
        self._limit = limit

    def subscribe(self) -> CacheFeed:
        feed = CacheFeed()
        self._feeds.append(feed)
        return feed

    def unsubscribe(self, feed: CacheFeed) -> None:
        self._feeds.remove(feed)

    def publish(self, block_hash: bytes, standing: str) -> None:
        for feed in self._feeds:
            if not feed.stale:
                feed.changes[block_hash] = standing
                if len(feed.changes) > self._limit:
                    feed.stale = True
                    feed.changes = {}

    @staticmethod
    def take(feed: CacheFeed, listing: Callable[[], dict[bytes, str]]) -> tuple[bool, dict[bytes, str]]:
        """(True, ``listing()``) for a stale feed, else (False, the changes since the last take)."""
        if feed.stale:
            feed.stale = False
            feed.changes = {}
            return True, listing()
        changes, feed.changes = feed.changes, {}
        return False, changes


@dataclass(frozen=True)
class CachedPrefix:
    """A prompt's tokens the prefix cache would serve now, and of those the ones in blocks no request
    holds: the ones that eviction can take before the prompt runs."""

    tokens: int
    evictable_tokens: int


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns every KV block: reference counts, the prefix-hash index and the LRU free queue.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        on_evict: called with a block hash whenever a cached block is reused for other tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[bytes], None] | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, KVBlock] = {}
        self._on_evict = on_evict
        self._num_cached_free = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._feeds = CacheFeeds(limit=2 * num_blocks + 1024)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a findable prefix."""
        return self._num_cached_free

    def find_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[KVBlock]:
        """Longest run of cached blocks matching the prefix, with stored tokens verified. No side effects."""
        hits: list[KVBlock] = []
        size = self.block_size
        for index, block_hash in enumerate(block_hashes):
            block = self._by_hash.get(block_hash)
            if block is None or block.token_ids != tuple(token_ids[index * size:(index + 1) * size]):
                break
            hits.append(block)
        return hits

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """What of ``token_ids`` the cache would serve now: full blocks, capped so one token is left to compute.

        Read-only and cheap: it hashes the full blocks of the prompt and looks them up.
        """
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size, max_cache_hit_blocks(len(token_ids), self.block_size))
        hits = self.find_cached_blocks(hashes, token_ids)
        return CachedPrefix(len(hits) * self.block_size,
                            sum(1 for block in hits if block.ref_count == 0) * self.block_size)

    def subscribe(self) -> CacheFeed:
        return self._feeds.subscribe()

    def unsubscribe(self, feed: CacheFeed) -> None:
        self._feeds.unsubscribe(feed)

    def take_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        """(True, every cached hash's standing) for a stale feed, else (False, the changes since the last take)."""
        return self._feeds.take(feed, lambda: {h: HELD if block.ref_count else FREE for h, block in self._by_hash.items()})

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def num_reclaimable(self, blocks: Sequence[KVBlock]) -> int:
        """How many free blocks would remain for allocation after taking hold of ``blocks``."""
        return self.num_free_blocks - sum(1 for block in blocks if block.ref_count == 0)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
                if block.block_hash is not None:
                    self._num_cached_free -= 1
                    self._feeds.publish(block.block_hash, HELD)
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the head of the free queue, or None if there are too few."""
        if num_blocks > len(self._free):
            return None
        allocated = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_count = 1
            allocated.append(block_id)
        return allocated

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in order: blocks freed first are evicted first.

        A block that holds no reusable content goes to the head of the queue, to be reused before any
        cached block.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._num_cached_free += 1
                    self._feeds.publish(block.block_hash, FREE)

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Publish a full, computed block under its chain hash. A hash already published keeps its block."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._by_hash[block_hash] = block
        self._feeds.publish(block_hash, HELD if block.ref_count else FREE)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block. Only valid while no request holds blocks."""
        if self.num_used_blocks:
            raise RuntimeError("cannot reset the prefix cache while blocks are in use")
        for block in list(self._by_hash.values()):
            self._evict(block)
        self._num_cached_free = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        del self._by_hash[block_hash]
        block.block_hash = None
        block.token_ids = None
        if self._on_evict is not None:
            self._on_evict(block_hash)
        self._feeds.publish(block_hash, REMOVED)
