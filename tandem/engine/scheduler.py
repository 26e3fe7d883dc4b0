"""Continuous-batching scheduler: FCFS admission, chunked prefill, a per-step token budget, preemption."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.engine.block_pool import BlockPool, CacheFeed, CachedPrefix
from tandem.engine.config import SchedulerConfig
from tandem.errors import QueueFullError
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.step_time import step_budget


@dataclass(frozen=True)
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request``, starting at position ``start``, computed this step.

    ``samples`` is True when the step reaches the end of the request's tokens, so a token is sampled.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> "ScheduledRequest":
        start = request.num_computed_tokens
        return cls(request, start, num_new_tokens, start + num_new_tokens == request.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_decode_requests(self) -> int:
        return sum(1 for item in self.scheduled if item.num_new_tokens == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled if item.num_new_tokens > 1)


@dataclass(frozen=True)
class RequestLoad:
    """One request's remaining work.

    ``prefill_tokens``: for a running request its unfinished prefill; for a waiting one its prompt
    tokens not covered by the cache estimate made when it was queued (lowered on eviction), and
    ``cached_tokens`` the tokens that estimate still counts on (0 for a running request).
    """

    req_id: str
    running: bool
    prefill_tokens: int
    decode_budget: int
    cached_tokens: int = 0
    constrained: bool = False  # it has a structured output


@dataclass(frozen=True)
class SchedulerLoad:
    """The work a scheduler holds, in the units the router's score uses."""

    requests: tuple[RequestLoad, ...]
    num_kv_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.requests if r.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.requests if not r.running)

    @property
    def running_prefill_tokens(self) -> int:
        return sum(r.prefill_tokens for r in self.requests if r.running)

    @property
    def running_decode_budget(self) -> int:
        return sum(r.decode_budget for r in self.requests if r.running)

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(r.prefill_tokens for r in self.requests if not r.running)

    @property
    def waiting_decode_budget(self) -> int:
        return sum(r.decode_budget for r in self.requests if not r.running)


class Scheduler:
    """Decides, step by step, which tokens of which requests are computed.

    Running requests are served first (decodes and unfinished prefill chunks), then waiting requests
    are admitted in arrival order while slots, token budget and KV blocks allow. When a running
    request needs a block and none is free, the most recently admitted request is preempted: its
    blocks are released and it is recomputed later (its cached prefix usually survives).

    ``clock`` stamps when a request is first scheduled and when it receives its first token (the engine
    passes its own clock, the simulator its virtual one).
    """

    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def pool(self) -> BlockPool:
        """The KV cache manager's block pool, for inspection."""
        return self.kv_cache_manager.block_pool

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.num_blocks

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        return self.kv_cache_manager.cached_prefix(token_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only while no request holds blocks)."""
        self.kv_cache_manager.reset_prefix_cache()

    def follow_prefix_cache(self) -> CacheFeed:
        """A feed of the prefix cache's hash index (``BlockPool.subscribe``)."""
        return self.kv_cache_manager.block_pool.subscribe()

    def prefix_cache_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        """``BlockPool.take_changes``: (whether this is a whole listing, each hash's newest standing)."""
        return self.kv_cache_manager.block_pool.take_changes(feed)

    def unfollow_prefix_cache(self, feed: CacheFeed) -> None:
        self.kv_cache_manager.block_pool.unsubscribe(feed)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queue a request and record how much of its prompt the cache holds now.

        Raises:
            QueueFullError: the waiting queue is at ``max_waiting_requests``.
        """
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests); retry later"
            )
        self.kv_cache_manager.estimate_cache(request)
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        decoding = any(r.prefill_remaining == 0 for r in self.running)
        used = 0
        budget = step_budget(self.config, decoding, used)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest.of(request, num_new))
                used += num_new
                budget = step_budget(self.config, decoding, used)
                index += 1

        while (
            self.waiting
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_active_requests
            and self.waiting[0].prompt_ready
        ):
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            scheduled.append(item)
            used += item.num_new_tokens
            budget = step_budget(self.config, decoding, used)
        return SchedulerOutput(scheduled, preempted)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Sequence[int | None],
        check_stop: Callable[[Request], RequestStatus | None] | None = None,
    ) -> list[Request]:
        """Apply an executed step: account computed tokens, append sampled ones, finish the requests that stop.

        A request's first sampled token stamps its ``first_token_time`` from the clock. Requests finished
        while the step ran are skipped.

        Args:
            output: the step's schedule.
            sampled: per scheduled request, the sampled token, or None where the step did not sample.
            check_stop: given a request that just received a token, the status that ends it, or None to
                keep it running. Without it, no request is finished here.

        Returns:
            The requests that received a token, in schedule order, those that ``check_stop`` ended included.
        """
        now = self.clock()
        cache_blocks = self.kv_cache_manager.cache_blocks
        updated = []
        for item, token in zip(output.scheduled, sampled):
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = item.start + item.num_new_tokens
            cache_blocks(request)
            if token is not None:
                request.token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                updated.append(request)
        if check_stop is not None:
            for request in updated:
                status = check_stop(request)
                if status is not None:
                    self.finish(request, status)
        return updated

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is and release its blocks."""
        if request.status.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status

    def load(self) -> SchedulerLoad:
        running = (RequestLoad(r.req_id, True, r.prefill_remaining, r.decode_budget, constrained=r.constrained)
                   for r in self.running)
        waiting = (
            RequestLoad(r.req_id, False, r.num_tokens - r.num_cached_estimate, r.decode_budget, r.num_cached_estimate,
                        r.constrained)
            for r in self.waiting
        )
        pool = self.pool
        return SchedulerLoad(
            requests=(*running, *waiting),
            num_kv_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            prefix_queried_tokens=pool.num_queried_tokens,
            prefix_hit_tokens=pool.num_hit_tokens,
        )

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        computed_blocks = self.kv_cache_manager.get_computed_blocks(request)
        num_cached = len(computed_blocks) * self.block_size
        num_new = self._chunk(request, request.num_tokens - num_cached, budget)
        if not self.kv_cache_manager.admit(request, computed_blocks, num_new):
            return None

        self.waiting.popleft()
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        request.num_prefill_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        self.running.append(request)
        return ScheduledRequest.of(request, num_new)

    def _chunk(self, request: Request, uncomputed: int, budget: int) -> int:
        """Tokens of ``request`` this step computes: a prompt whose log-probabilities are asked for at most
        ``max_num_batched_tokens`` (each of its tokens takes a row of logits)."""
        if request.wants_prompt_logprobs:
            budget = min(budget, self.config.max_num_batched_tokens)
        return min(uncomputed, budget)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.kv_cache_manager.estimate_cache(request)
        self.waiting.appendleft(request)
