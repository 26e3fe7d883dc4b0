"""The chain hash that names a full KV block: the hash of its parent block's hash and its own token ids,
starting from a fixed seed. Equal prefixes give equal hashes in every process and on every machine, so a
worker's cache and the router's index of it speak of the same blocks."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

ROOT_HASH = hashlib.blake2b(b"tandem.kv.v1", digest_size=16).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full block: deterministic across processes and machines."""
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return hashlib.blake2b(parent_hash + tokens.tobytes(), digest_size=16).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, limit: int) -> None:
    """Append the chain hashes of full blocks of ``token_ids`` until ``hashes`` covers ``limit`` blocks."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for index in range(len(hashes), min(limit, len(token_ids) // block_size)):
        parent = hash_block(parent, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(parent)


def max_cache_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a hit may cover: at least one token must be computed so that its logits exist."""
    return max(0, num_tokens - 1) // block_size
