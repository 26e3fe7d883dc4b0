"""Each worker's prefix cache as the router follows it (WatchState with ``prefix_cache_changes``), and the
prompts' block hashes to look up in it: a prompt's cached prefix on a worker, without asking the worker.

The index also counts the prompt blocks the router has just sent to a worker as expected hits there, until
the worker's changes confirm them (held or free) or evict them, or ``EXPECTED_HIT_TTL_S`` passes without
either (the request ended before its prefill). A prompt repeated at once thus finds the worker that is
computing its prefix, before the worker has reported a block of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tandem.prefix_hash import extend_block_hashes, max_cache_hit_blocks
from tandem.v1 import common_pb2

EXPECTED_HIT_TTL_S = 30.0
MAX_EXPECTED_BLOCKS = 65536  # past this many, lapsed expectations are swept


class PromptBlocks:
    """A prompt's block chain hashes, computed once for each block size asked."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = token_ids
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        """The hashes of the full blocks a cache hit may cover (one token is always left to compute)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = []
            extend_block_hashes(hashes, self.token_ids, block_size,
                                max_cache_hit_blocks(len(self.token_ids), block_size))
            self._hashes[block_size] = hashes
        return hashes


class PrefixIndex:
    """The block hashes one worker caches, each held by a request or free (evictable).

    ``synced`` from the end of the first whole listing until ``forget``: only then does a lookup answer
    as the worker would.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._held: dict[bytes, bool] = {}
        self._expected: dict[bytes, float] = {}  # hash -> when the expectation lapses
        self._clock = clock
        self._listing = False
        self.synced = False

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, changes: common_pb2.PrefixCacheChanges) -> None:
        if changes.reset:
            self._held.clear()
            self._listing = True
            self.synced = False
        held, expected = self._held, self._expected
        for block_hash in changes.held:
            held[block_hash] = True
            expected.pop(block_hash, None)
        for block_hash in changes.free:
            held[block_hash] = False
            expected.pop(block_hash, None)
        for block_hash in changes.removed:
            held.pop(block_hash, None)
            expected.pop(block_hash, None)
        if self._listing and not changes.continued:
            self._listing = False
            self.synced = True

    def forget(self) -> None:
        """The stream that fed this index ended: nothing is known until the next whole listing."""
        self._held.clear()
        self._expected.clear()
        self._listing = False
        self.synced = False

    def expect(self, prompt: PromptBlocks, block_size: int) -> None:
        """``prompt`` was just sent to this worker: count its blocks the index does not show as expected hits."""
        now = self._clock()
        if len(self._expected) > MAX_EXPECTED_BLOCKS:
            self._expected = {h: until for h, until in self._expected.items() if until > now}
        until = now + EXPECTED_HIT_TTL_S
        for block_hash in prompt.hashes(block_size):
            if block_hash not in self._held:
                self._expected[block_hash] = until

    def cached(self, prompt: PromptBlocks, block_size: int) -> tuple[int, int]:
        """(Tokens of ``prompt`` the worker's cache holds, of those the ones in blocks no request holds). An
        expected hit counts as held: the request it was sent with holds it."""
        tokens = evictable = 0
        held, expected, now = self._held, self._expected, self._clock()
        for block_hash in prompt.hashes(block_size):
            standing = held.get(block_hash)
            if standing is None:
                if expected.get(block_hash, 0.0) <= now:
                    expected.pop(block_hash, None)
                    break
                standing = True
            tokens += block_size
            if not standing:
                evictable += block_size
        return tokens, evictable
