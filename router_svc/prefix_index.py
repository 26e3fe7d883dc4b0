"""Each worker's prefix cache as the router follows it (WatchState with ``prefix_cache_changes``), and the
prompts' block hashes to look up in it: a prompt's cached prefix on a worker, without asking the worker."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.prefix_hash import extend_block_hashes, max_cache_hit_blocks
from tandem.v1 import common_pb2


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

    def __init__(self):
        self._held: dict[bytes, bool] = {}
        self._listing = False
        self.synced = False

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, changes: common_pb2.PrefixCacheChanges) -> None:
        if changes.reset:
            self._held.clear()
            self._listing = True
            self.synced = False
        held = self._held
        for block_hash in changes.held:
            held[block_hash] = True
        for block_hash in changes.free:
            held[block_hash] = False
        for block_hash in changes.removed:
            held.pop(block_hash, None)
        if self._listing and not changes.continued:
            self._listing = False
            self.synced = True

    def forget(self) -> None:
        """The stream that fed this index ended: nothing is known until the next whole listing."""
        self._held.clear()
        self._listing = False
        self.synced = False

    def cached(self, prompt: PromptBlocks, block_size: int) -> tuple[int, int]:
        """(Tokens of ``prompt`` the worker's cache holds, of those the ones in blocks no request holds)."""
        tokens = evictable = 0
        held = self._held
        for block_hash in prompt.hashes(block_size):
            standing = held.get(block_hash)
            if standing is None:
                break
            tokens += block_size
            if not standing:
                evictable += block_size
        return tokens, evictable
