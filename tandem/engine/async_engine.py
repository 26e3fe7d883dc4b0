"""The asyncio front of the engine.

``AsyncEngine`` runs an ``LLMEngine`` on a background thread (the model step releases the GIL) and gives
every request an async iterator of outputs.

The model's CPU work belongs to that thread once it starts. libgomp (torch's OpenMP runtime) keeps a team
of worker threads for every thread that has run a parallel region, for as long as that thread lives, and
once it manages more threads than there are CPUs its workers barely spin between regions: they sleep and
are woken for each of the hundreds of regions in a decode step, which took a third of single-stream
decode speed. So ``start`` hands back the team of the thread that built and warmed the model.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from tandem.engine.block_pool import CacheFeed, CachedPrefix
from tandem.engine.config import DEFAULT_ENGINE_PRIORITY, ENGINE_PRIORITIES
from tandem.engine.engine import EngineState, LLMEngine, RequestOutput
from tandem.engine.request import Request
from tandem.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread and streams each request's outputs.

    Every public method is safe to call from the event loop; each takes the engine lock only for
    bookkeeping, never across a model step.
    """

    def __init__(self, engine: LLMEngine, on_failure: Callable[[str], None] | None = None,
                 on_step: Callable[[SchedulerOutput], None] | None = None, priority: str = DEFAULT_ENGINE_PRIORITY):
        """Args:
            engine: the engine to run.
            on_failure: called once, from the engine thread, with the reason when a model step fails.
            on_step: called from the engine thread, outside the lock, with the schedule of every step
                the model executed (after its outputs are delivered); it must be quick and not raise.
            priority: ``normal``, or ``batch``: the engine thread runs in Linux's SCHED_BATCH class, so
                that on a host shared with a router and clients their short wake-ups go ahead of a step.
        """
        if priority not in ENGINE_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(ENGINE_PRIORITIES)}; got {priority!r}")
        self.engine = engine
        self.priority = priority
        self._on_failure = on_failure
        self._on_step = on_step
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._executing = False  # a scheduled step is running on the model, outside the lock
        self._deferred_aborts: list[str] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread; the calling thread's OpenMP team is handed back first."""
        release_openmp_team()
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread; requests still in flight end as aborted."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            outputs = [self.engine.abort(req_id) for req_id in list(self._streams)]
        self._deliver([out for out in outputs if out is not None])

    async def close(self) -> None:
        """``stop``, off the event loop (it waits for the step in flight)."""
        await asyncio.to_thread(self.stop)

    @property
    def healthy(self) -> bool:
        return self.engine.healthy and self._thread.is_alive()

    async def generate(self, request: Request,
                       on_queued: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until the last one.

        ``on_queued``, if given, is awaited once the request is queued, before its first output; if it
        raises or is cancelled, the request is aborted and the exception propagates.
        Closing or abandoning the iterator (or cancelling its task) aborts the request; its blocks are
        freed at once, or when the step in flight ends if that step computes it. Validation errors are raised before the first output.
        """
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if request.sampling.structured_output is not None:
            await asyncio.to_thread(self.engine.constrain, request)
        with self._wakeup:
            self.engine.add_request(request)
            self._streams[request.req_id] = (asyncio.get_running_loop(), queue)
            self._wakeup.notify()
            self._notify_watchers()
        finished = False
        try:
            if on_queued is not None:
                await on_queued()
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request.req_id)

    def abort(self, req_id: str) -> None:
        with self._lock:
            self._streams.pop(req_id, None)
            if self._executing:
                # The step being executed reads this request's blocks; release them once it ends.
                self._deferred_aborts.append(req_id)
            elif self.engine.abort(req_id) is not None:
                self._notify_watchers()

    async def wait_for_change(self, seq: int, timeout: float) -> None:
        """Return once the state's sequence number differs from ``seq``, or after ``timeout`` seconds."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self.engine.seq != seq:
                return
            self._watchers.add(entry)
        try:
            await asyncio.wait_for(entry[1].wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._watchers.discard(entry)

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        with self._lock:
            return self.engine.cached_prefix(token_ids)

    def follow_prefix_cache(self) -> CacheFeed:
        """A feed of the prefix cache's hash index: its first take lists every cached hash."""
        with self._lock:
            return self.engine.follow_prefix_cache()

    def prefix_cache_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        """``BlockPool.take_changes``: (whether this is a whole listing, each hash's newest standing)."""
        with self._lock:
            return self.engine.prefix_cache_changes(feed)

    def unfollow_prefix_cache(self, feed: CacheFeed) -> None:
        with self._lock:
            self.engine.unfollow_prefix_cache(feed)

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.engine.reset_prefix_cache()

    def state(self) -> EngineState:
        with self._lock:
            state = self.engine.state()
        if state.healthy and not self._thread.is_alive() and self._thread.ident is not None:
            return dataclasses.replace(state, healthy=False)
        return state

    def _run(self) -> None:
        if self.priority == "batch":
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except (AttributeError, OSError) as exc:  # not Linux, or a sandbox that forbids it
                logger.info("the engine thread keeps its scheduling class: %r", exc)
        while True:
            with self._wakeup:
                while not self.engine.has_work() and not self._stopping:
                    self._wakeup.wait()
                if self._stopping:
                    return
                output = self.engine.schedule()
                self._executing = bool(output.scheduled)
            if not output.scheduled:
                time.sleep(0.001)
                continue
            start = time.perf_counter()
            try:
                sampled = self.engine.execute(output)
            except Exception as exc:  # any failure of the model step ends every request with it
                logger.exception("model step failed; the engine stops")
                reason = f"model step failed: {type(exc).__name__}: {exc}"
                with self._lock:
                    self._end_step()
                    outputs = self.engine.fail_all(reason)
                self._deliver(outputs)
                if self._on_failure is not None:
                    self._on_failure(reason)
                return
            with self._lock:
                outputs = self.engine.process(output, sampled, time.perf_counter() - start)
                self._end_step()
            self._deliver(outputs)
            if self._on_step is not None:
                self._on_step(output)

    def _end_step(self) -> None:
        """Apply the aborts that arrived while the step ran. Call with the lock held."""
        self._executing = False
        for req_id in self._deferred_aborts:
            self.engine.abort(req_id)
        self._deferred_aborts.clear()

    def _notify_watchers(self) -> None:
        """Wake every ``wait_for_change`` caller. Call with the lock held."""
        for loop, event in self._watchers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that watcher's event loop is closed
                pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            self._notify_watchers()
            targets = []
            for output in outputs:
                stream = self._streams.get(output.req_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.req_id]
                targets.append((stream, output))
        for (loop, queue), output in targets:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the consumer's event loop is closed; nobody is listening
                pass


def release_openmp_team() -> None:
    """Hand back the OpenMP worker threads the calling thread holds in the libgomp torch has loaded
    (``omp_pause_resource_all``); the next parallel region of this thread makes a new team. Nothing to do
    where no libgomp is loaded or it cannot pause."""
    try:
        pause = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_pause_resource_all
    except (OSError, AttributeError):  # none loaded, one older than OpenMP 5, or a platform without RTLD_NOLOAD
        return
    omp_pause_soft = 1
    pause(omp_pause_soft)
