"""vLLM's prefix cache, rebuilt from its KV cache events under Tandem's chain hash.

vLLM names a stored block by its own hash and sends the block's token ids with it. Each block is rehashed
with Tandem's chain hash (``hash_block``) at vLLM's block size, so that a router looks prompts up in a
vLLM worker's index exactly as in a Tandem worker's; vLLM's hash is kept only to resolve parents and
removals. A block is ``HELD`` while a running request's prompt covers it, else ``FREE``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from tandem.engine.block_pool import FREE, HELD, REMOVED, CacheFeed, CacheFeeds, CachedPrefix
from tandem.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block, max_cache_hit_blocks


class VllmPrefixIndex:
    """The Tandem hashes of the blocks one vLLM engine caches, followed through ``CacheFeed``s.

    Args:
        block_size: vLLM's tokens per block.
        feed_limit: changes a feed may pile up before it is sent the whole index instead.
    """

    def __init__(self, block_size: int, feed_limit: int):
        self.block_size = block_size
        self.feeds = CacheFeeds(feed_limit)
        self._tandem_hash: dict[Hashable, bytes] = {}  # vLLM's block hash -> Tandem's
        self._copies: Counter[Hashable] = Counter()  # vLLM blocks stored under each vLLM hash
        self._holders: Counter[bytes] = Counter()  # running requests whose prompt covers each Tandem hash
        self._cached: set[bytes] = set()
        self._num_held_cached = 0  # hashes in _cached that a running request holds

    def __len__(self) -> int:
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached) - self._num_held_cached

    def store(self, parent: Hashable | None, vllm_hashes: Sequence[Hashable], token_ids: Sequence[int]) -> int:
        """Index blocks vLLM stored: a chain under ``parent`` (None: the prompt's start) holding ``token_ids``.

        Returns:
            How many were indexed: none whose parent the index does not know (it was cleared since).
        """
        if parent is None:
            tandem_parent = ROOT_HASH
        elif parent in self._tandem_hash:
            tandem_parent = self._tandem_hash[parent]
        else:
            return 0
        size = self.block_size
        for index, vllm_hash in enumerate(vllm_hashes):
            tandem_parent = hash_block(tandem_parent, token_ids[index * size:(index + 1) * size])
            self._tandem_hash[vllm_hash] = tandem_parent
            self._copies[vllm_hash] += 1
            if tandem_parent not in self._cached:
                self._cached.add(tandem_parent)
                self._num_held_cached += bool(self._holders[tandem_parent])
                self.feeds.publish(tandem_parent, self._standing(tandem_parent))
        return len(vllm_hashes)

    def remove(self, vllm_hashes: Sequence[Hashable]) -> None:
        for vllm_hash in vllm_hashes:
            if vllm_hash not in self._copies:
                continue
            self._copies[vllm_hash] -= 1
            if self._copies[vllm_hash] > 0:
                continue
            del self._copies[vllm_hash]
            block_hash = self._tandem_hash.pop(vllm_hash)
            self._cached.discard(block_hash)
            self._num_held_cached -= bool(self._holders[block_hash])
            self.feeds.publish(block_hash, REMOVED)

    def clear(self) -> None:
        for block_hash in self._cached:
            self.feeds.publish(block_hash, REMOVED)
        self._cached.clear()
        self._num_held_cached = 0
        self._tandem_hash.clear()
        self._copies.clear()

    def hold(self, block_hashes: Sequence[bytes]) -> None:
        """A request that covers ``block_hashes`` started running."""
        for block_hash in block_hashes:
            self._holders[block_hash] += 1
            if self._holders[block_hash] == 1 and block_hash in self._cached:
                self._num_held_cached += 1
                self.feeds.publish(block_hash, HELD)

    def release(self, block_hashes: Sequence[bytes]) -> None:
        """A request passed to ``hold`` ended."""
        for block_hash in block_hashes:
            self._holders[block_hash] -= 1
            if self._holders[block_hash] == 0:
                del self._holders[block_hash]
                if block_hash in self._cached:
                    self._num_held_cached -= 1
                    self.feeds.publish(block_hash, FREE)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain hashes of every full block of ``token_ids``."""
        hashes: list[bytes] = []
        extend_block_hashes(hashes, token_ids, self.block_size, len(token_ids) // self.block_size)
        return hashes

    def cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> CachedPrefix:
        """What of ``token_ids`` vLLM's cache serves now: full blocks, one token always left to compute."""
        limit = max_cache_hit_blocks(len(token_ids), self.block_size)
        hashes = self.prompt_hashes(token_ids) if hashes is None else hashes
        tokens = evictable = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._cached:
                break
            tokens += self.block_size
            if not self._holders[block_hash]:
                evictable += self.block_size
        return CachedPrefix(tokens, evictable)

    def subscribe(self) -> CacheFeed:
        return self.feeds.subscribe()

    def unsubscribe(self, feed: CacheFeed) -> None:
        self.feeds.unsubscribe(feed)

    def take_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        return self.feeds.take(feed, lambda: {block_hash: self._standing(block_hash) for block_hash in self._cached})

    def _standing(self, block_hash: bytes) -> str:
        return HELD if self._holders[block_hash] else FREE
