"""The router's admission control: at most ``max_inflight`` requests run, at most ``max_queued`` wait.

A request that finds the queue full, or waits longer than ``queue_timeout_s``, is refused at once
with a reason: overload never piles up in an unbounded queue.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router_svc.errors import RoutingError, Status


class AdmissionRefused(RoutingError):
    """The request was not admitted (queue full or queue timeout); the message says which."""

    def __init__(self, message: str):
        super().__init__(Status.RESOURCE_EXHAUSTED, message)


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float):
        if max_inflight <= 0 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError("max_inflight and queue_timeout_s must be positive, max_queued >= 0")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in FIFO order up to ``queue_timeout_s``.

        Raises:
            AdmissionRefused: the queue is full, or the wait timed out.
        """
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise AdmissionRefused(f"the router is at capacity: {self.inflight} requests running and "
                                   f"{len(self._waiters)} queued (limit {self.max_queued}); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived as the wait ended: pass it on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise AdmissionRefused(f"waited {self.queue_timeout_s:g} s in the router's queue without a free slot "
                                       f"({self.inflight} requests running); retry later") from None
            raise

    def release(self) -> None:
        """Give a slot back: to the longest waiter, or to the pool."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.inflight -= 1
