"""vLLM's KV cache events, received in order over ZMQ and applied to a ``VllmPrefixIndex``.

vLLM's engine core publishes ``[topic, sequence number, msgpack batch]`` on a PUB socket and keeps recent
batches for replay on a ROUTER socket. A gap in the sequence numbers (a slow start, a dropped message) is
filled from the replay; when the replay no longer holds the missed batches, the index cannot be trusted,
and ``on_lost`` must resynchronise it (clear it and the cache it mirrors).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tandem.vllm_engine.prefix_index import VllmPrefixIndex

logger = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0


class KVEventStream:
    """Follows one vLLM engine's KV events into ``index`` until ``close``.

    Args:
        index: where the events go.
        endpoint: vLLM's PUB socket (``KVEventsConfig.endpoint``).
        replay_endpoint: vLLM's replay socket (``KVEventsConfig.replay_endpoint``).
        topic: vLLM's topic (``KVEventsConfig.topic``).
        on_lost: awaited when batches were missed for good, after the index is cleared.
    """

    def __init__(self, index: VllmPrefixIndex, endpoint: str, replay_endpoint: str, topic: str,
                 on_lost: Callable[[], Awaitable[None]], on_applied: Callable[[], None] = lambda: None):
        self.index = index
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._on_lost = on_lost
        self._on_applied = on_applied
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.asyncio.Context()
        self._subscriber = self._context.socket(zmq.SUB)
        self._subscriber.connect(endpoint)
        self._subscriber.setsockopt(zmq.SUBSCRIBE, self._topic)
        self.next_seq = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._context.destroy(linger=0)

    async def _run(self) -> None:
        while True:
            _, seq_bytes, payload = await self._subscriber.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:  # already applied from a replay
                continue
            if seq > self.next_seq:
                await self._catch_up(seq)
            self._apply(seq, payload)

    async def _catch_up(self, seq: int) -> None:
        """Apply the batches from ``next_seq`` up to ``seq`` from vLLM's replay, or resynchronise."""
        missed_from = self.next_seq
        try:
            await asyncio.wait_for(self._replay(seq), REPLAY_TIMEOUT_S)
        except TimeoutError:
            pass
        if self.next_seq < seq:
            logger.warning("KV events %d to %d were lost; resynchronising the prefix index", missed_from, seq - 1)
            self.index.clear()
            self.next_seq = seq
            await self._on_lost()

    async def _replay(self, until: int) -> None:
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                _, _, seq_bytes, payload = await dealer.recv_multipart()
                if seq_bytes == _END_OF_REPLAY:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq == self.next_seq and seq < until:
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        index = self.index
        for event in self._decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                if event.block_size != index.block_size:
                    logger.warning("a KV event names block size %d, not %d; skipped", event.block_size, index.block_size)
                elif not event.lora_name and not any(event.extra_keys or ()):  # Tandem's prompts carry neither
                    index.store(event.parent_block_hash, event.block_hashes, event.token_ids)
            elif isinstance(event, BlockRemoved):
                index.remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.clear()
        self.next_seq = seq + 1
        self._on_applied()
