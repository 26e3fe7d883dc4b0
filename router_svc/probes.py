"""Estimate probes to one worker over its long-lived EstimateStream call."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc


class ProbeStream:
    """Sends each probe as one message on a call that stays open, instead of starting a call per probe.

    The worker answers in the order it was asked, so every answer belongs to the oldest probe still
    pending; a probe its caller stopped waiting for has its late answer read and dropped. Once the
    call ends, every probe gets None, and ``closed`` tells the owner to open a new stream.

    Args:
        stub: the worker's stub; the call starts at once.
        max_pending: probes awaiting an answer (late ones included) beyond which a new probe gets
            None at once, so a stalled worker cannot make the queue grow without bound.
    """

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, max_pending: int = 256):
        self.max_pending = max_pending
        self.closed = False
        self._outgoing: asyncio.Queue[worker_pb2.EstimateRequest] = asyncio.Queue()
        self._pending: deque[asyncio.Future] = deque()
        self._call = stub.EstimateStream(self._requests())
        self._reader = asyncio.create_task(self._read())

    def ask(self, request: worker_pb2.EstimateRequest) -> asyncio.Future:
        """Send ``request``; the future gets the worker's BackendState, or None once the call has ended.

        Cancel the future to stop waiting; the answer, when it comes, is dropped.
        """
        answer = asyncio.get_running_loop().create_future()
        if self.closed or len(self._pending) >= self.max_pending:
            answer.set_result(None)
        else:
            self._pending.append(answer)
            self._outgoing.put_nowait(request)
        return answer

    def close(self) -> None:
        self.closed = True
        self._call.cancel()
        while self._pending:
            answer = self._pending.popleft()
            if not answer.done():
                answer.set_result(None)

    async def _requests(self):
        while True:
            yield await self._outgoing.get()

    async def _read(self) -> None:
        try:
            async for state in self._call:
                if not self._pending:  # an answer nobody asked for: the stream is out of step
                    return
                answer = self._pending.popleft()
                if not answer.done():
                    answer.set_result(state)
        except grpc.aio.AioRpcError:
            pass
        finally:
            self.close()
