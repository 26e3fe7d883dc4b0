"""The scheduler's access to the KV cache: cached prefixes, slots for new tokens, publishing and freeing.

Modelled on vLLM v1's ``KVCacheManager``: the scheduler asks for a request's computed blocks and for
slots, and never sees a block hash. The manager also keeps the cache estimate of every queued request
(how much of its prompt the cache held when it was queued), corrected when a block it counted on is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.block_pool import BlockPool, CachedPrefix, KVBlock
from tandem.prefix_hash import extend_block_hashes, max_cache_hit_blocks
from tandem.engine.request import Request


class KVCacheManager:
    """Hands out a block pool's blocks to requests and keeps their prefixes findable.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, block_size, on_evict=self._on_evict)
        self._estimate_dependents: dict[bytes, set[Request]] = {}

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Find the cached blocks a prefix hit would give ``request`` now. Takes hold of none.

        Args:
            request: a waiting request.

        Returns:
            The longest run of cached blocks matching its tokens, capped so that one token is left to compute;
            none for a request that wants its prompt's log-probabilities, which only computing gives.
        """
        if request.wants_prompt_logprobs:
            return []
        limit = max_cache_hit_blocks(request.num_tokens, self.block_size)
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, limit)
        return self.block_pool.find_cached_blocks(request.block_hashes[:limit], request.token_ids)

    def admit(self, request: Request, computed_blocks: Sequence[KVBlock], num_new_tokens: int) -> bool:
        """Give a waiting request its cached blocks and the blocks for its first new tokens.

        On success the request's queue estimate is dropped and the lookup counts in the prefix hit rate.

        Args:
            request: the waiting request, holding no blocks and no computed tokens.
            computed_blocks: what ``get_computed_blocks`` returned for it.
            num_new_tokens: tokens to compute after the cached ones in this step.

        Returns:
            True, or False with nothing changed when too few blocks are free.
        """
        size = self.block_size
        num_cached = len(computed_blocks) * size
        num_new_blocks = request.num_required_blocks(num_cached + num_new_tokens, size) - len(computed_blocks)
        if num_new_blocks > self.block_pool.num_reclaimable(computed_blocks):
            return False
        self._forget_estimate(request)
        self.block_pool.touch(computed_blocks)
        request.block_ids = [block.block_id for block in computed_blocks] + self.block_pool.allocate(num_new_blocks)
        self.block_pool.record_lookup(request.num_tokens, num_cached)
        request.num_published_blocks = len(computed_blocks)
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give a running request the blocks for ``num_new_tokens`` more tokens.

        Args:
            request: a running request.
            num_new_tokens: tokens to compute after its computed tokens in this step.

        Returns:
            True, or False with nothing changed when too few blocks are free.
        """
        num_new_blocks = request.num_required_blocks(num_new_tokens, self.block_size) - len(request.block_ids)
        if num_new_blocks <= 0:
            return True
        block_ids = self.block_pool.allocate(num_new_blocks)
        if block_ids is None:
            return False
        request.block_ids.extend(block_ids)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Publish the request's blocks that computed tokens have filled since the last call.

        Args:
            request: a running request whose ``num_computed_tokens`` was just advanced.
        """
        num_full = request.num_computed_full_blocks(self.block_size)
        if num_full <= request.num_published_blocks:
            return
        size = self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids, size, num_full)
        for index in range(request.num_published_blocks, num_full):
            self.block_pool.cache_block(
                request.block_ids[index], request.block_hashes[index], request.block_token_ids(index, size)
            )
        request.num_published_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the tail is evicted first), and its queue estimate.

        Args:
            request: a request that is finished, or preempted back to the queue.
        """
        self._forget_estimate(request)
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_published_blocks = 0

    def estimate_cache(self, request: Request) -> None:
        """Record how much of a queued request's tokens the cache holds now, in ``num_cached_estimate``.

        The estimate shrinks when a block it counts on is evicted, until ``admit`` or ``free`` drops it.

        Args:
            request: a request entering the waiting queue.
        """
        hits = self.get_computed_blocks(request)
        request.cache_estimate_hashes = [block.block_hash for block in hits]
        request.num_cached_estimate = len(hits) * self.block_size
        for block_hash in request.cache_estimate_hashes:
            self._estimate_dependents.setdefault(block_hash, set()).add(request)

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """What of ``token_ids`` (a prompt) the cache would serve now. Read-only.

        Returns:
            Tokens in cached full blocks, capped so that one token is left to compute, and of those the
            ones no request holds.
        """
        return self.block_pool.cached_prefix(token_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block; only valid while no request holds blocks."""
        self.block_pool.reset_prefix_cache()

    def _forget_estimate(self, request: Request) -> None:
        for block_hash in request.cache_estimate_hashes:
            dependents = self._estimate_dependents.get(block_hash)
            if dependents is not None:
                dependents.discard(request)
                if not dependents:
                    del self._estimate_dependents[block_hash]
        request.cache_estimate_hashes = []

    def _on_evict(self, block_hash: bytes) -> None:
        """A cached block was reused: waiting requests that counted on it lose it and every block after it."""
        for request in list(self._estimate_dependents.get(block_hash, ())):
            kept = request.cache_estimate_hashes[:request.cache_estimate_hashes.index(block_hash)]
            self._forget_estimate(request)
            request.cache_estimate_hashes = kept
            request.num_cached_estimate = len(kept) * self.block_size
            for kept_hash in kept:
                self._estimate_dependents.setdefault(kept_hash, set()).add(request)
