"""The engine: scheduler + model executor + detokenization, and its asyncio streaming front.

``LLMEngine`` is synchronous and single-threaded. ``AsyncEngine`` runs it on a background thread
(the model step releases the GIL) and gives every request an async iterator of outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.engine.config import SchedulerConfig
from tandem.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from tandem.engine.errors import EngineDeadError, InvalidRequestError
from tandem.engine.rates import Rates, RateTracker, StepSample
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.engine.scheduler import SchedulerLoad, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """What the engine needs from a model runner."""

    device: str
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    def execute(self, output: SchedulerOutput) -> list[int | None]:
        """Run one step; return the sampled token per scheduled request (None where none is sampled)."""


@dataclass(frozen=True)
class RequestStats:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int
    queue_time_s: float
    ttft_s: float | None
    total_time_s: float


@dataclass(frozen=True)
class RequestOutput:
    """One item of a request's stream: new tokens and text, and on the last item how it ended."""

    req_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    stats: RequestStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineState:
    """A consistent snapshot of the engine: the raw material of the router's score."""

    seq: int
    healthy: bool
    device: str
    max_active_requests: int
    block_size: int
    load: SchedulerLoad
    rates: Rates | None

    @property
    def pending_prefill_tokens(self) -> int:
        return self.load.running_prefill_tokens + self.load.waiting_prefill_tokens

    @property
    def pending_decode_budget(self) -> int:
        return self.load.running_decode_budget + self.load.waiting_decode_budget


class LLMEngine:
    """Admits, schedules and runs requests; produces their outputs step by step.

    Args:
        executor: runs a scheduled step on the model.
        tokenizer: decodes generated tokens to text.
        config: scheduler limits.
        clock: the time of request events (first scheduled, first token, finished).
    """

    def __init__(self, executor: ModelExecutor, tokenizer: Tokenizer, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.scheduler = Scheduler(config, executor.num_kv_blocks, clock)
        self.rates = RateTracker(config.max_num_batched_tokens, config.max_active_requests)
        self.seq = 0
        self.dead_reason: str | None = None
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_request(self, request: Request) -> None:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: a field is invalid; ``field`` names it.
            QueueFullError: the waiting queue is full.
            EngineDeadError: the engine failed and serves nothing more.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._validate(request)
        self.scheduler.add_request(request)
        self._requests[request.req_id] = request
        self._detokenizers[request.req_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.stop_strings
        )
        self.seq += 1

    def abort(self, req_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; None if it already ended."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.seq += 1
        return self._final_output(request, ())

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def process(self, output: SchedulerOutput, sampled: Sequence[int | None], seconds: float,
                record_step: Callable[[StepSample], None] | None = None) -> list[RequestOutput]:
        """Account for an executed step: record its time, append tokens, detokenize, check stops.

        Args:
            output: the step's schedule.
            sampled: what the executor returned for it.
            seconds: how long the step took.
            record_step: where the step's time goes; by default the rates' observed steps.
        """
        (record_step or self.rates.observe)(StepSample(output.num_prefill_tokens, output.num_decode_requests, seconds))
        outputs = []
        for request in self.scheduler.update_from_output(output, sampled, self._check_stop):
            token_ids = (request.token_ids[-1],)
            text = self._detokenizers[request.req_id].release()
            if request.status.is_finished:
                outputs.append(self._final_output(request, token_ids, text))
            else:
                outputs.append(RequestOutput(request.req_id, token_ids, text))
        self.seq += 1
        return outputs

    def step(self, record_step: Callable[[StepSample], None] | None = None) -> list[RequestOutput]:
        """Schedule, execute and process one step (synchronous use); ``record_step`` as in ``process``."""
        output = self.schedule()
        if not output.scheduled:
            return []
        start = time.perf_counter()
        sampled = self.executor.execute(output)
        return self.process(output, sampled, time.perf_counter() - start, record_step)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Mark the engine dead and end every request with an error naming the reason."""
        self.dead_reason = reason
        outputs = []
        for request in list(self._requests.values()):
            request.error = reason
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(self._final_output(request, ()))
        self.seq += 1
        return outputs

    def calibrate(self, repeats: int = 3) -> Rates:
        """Measure prefill and decode step times on the real device with synthetic requests.

        Each step shape is measured ``repeats`` times and its fastest time kept, so that a noisy
        neighbour does not skew the rates. The prefix cache is cleared afterwards: calibration leaves
        no trace but the rates.
        """
        rng = random.Random(0)
        vocab = self.executor.vocab_size
        budget = self.config.max_num_batched_tokens
        batch = self.config.max_active_requests
        counter = itertools.count()

        def measure(prompt_len: int, num_requests: int, step_index: int) -> StepSample:
            samples: list[StepSample] = []
            for _ in range(num_requests):
                prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
                self.add_request(Request(f"calibration-{next(counter)}", prompt, 2, ignore_eos=True,
                                         arrival_time=self.clock()))
            while self.has_work():
                self.step(record_step=samples.append)
            return samples[step_index]

        measure(min(64, budget), 1, 0)  # warm-up: first-call allocations are not a rate
        prefill_only, first_decode = 0, 1
        shapes = [(max(1, budget // 2), 1, prefill_only), (budget, 1, prefill_only), (16, batch, first_decode), (16, 1, first_decode)]
        for shape in shapes:
            samples = [measure(*shape) for _ in range(repeats)]
            self.rates.add_calibration(min(samples, key=lambda sample: sample.seconds))
        self.reset_prefix_cache()
        return self.rates.rates()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only while no request holds blocks)."""
        self.scheduler.kv_cache_manager.reset_prefix_cache()

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        return self.scheduler.kv_cache_manager.cached_prefix_len(token_ids)

    def state(self) -> EngineState:
        return EngineState(
            seq=self.seq,
            healthy=self.healthy,
            device=self.executor.device,
            max_active_requests=self.config.max_active_requests,
            block_size=self.config.block_size,
            load=self.scheduler.load(),
            rates=self.rates.rates() if self.rates.calibrated else None,
        )

    def _validate(self, request: Request) -> None:
        if request.req_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.req_id!r} is already in use")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.executor.vocab_size
        for token in request.prompt_token_ids:
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError("prompt_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(request.max_new_tokens, int) or request.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {request.max_new_tokens!r}")
        total = request.num_prompt_tokens + request.max_new_tokens
        if total > self.executor.max_model_len:
            raise InvalidRequestError(
                "max_new_tokens",
                f"prompt ({request.num_prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context length {self.executor.max_model_len}",
            )
        if request.max_num_blocks(self.config.block_size) > self.scheduler.pool.num_blocks:
            raise InvalidRequestError(
                "max_new_tokens",
                f"prompt + max_new_tokens ({total} tokens) exceeds the KV cache "
                f"({self.scheduler.pool.num_blocks * self.config.block_size} tokens)",
            )
        for token in request.stop_token_ids:
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError("stop_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab})")

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Detokenize the request's new token (``process`` releases its text); return the status it ends with."""
        token = request.token_ids[-1]
        detokenizer = self._detokenizers[request.req_id]
        detokenizer.push(token)
        if detokenizer.stopped or token in request.stop_token_ids:
            return RequestStatus.FINISHED_STOP
        if not request.ignore_eos and token in self.executor.eos_token_ids:
            return RequestStatus.FINISHED_EOS
        if request.decode_budget <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _final_output(self, request: Request, token_ids: tuple[int, ...], text: str = "") -> RequestOutput:
        del self._requests[request.req_id]
        text += self._detokenizers.pop(request.req_id).flush()
        now = self.clock()
        stats = RequestStats(
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            queue_time_s=(request.first_scheduled_time or now) - request.arrival_time,
            ttft_s=None if request.first_token_time is None else request.first_token_time - request.arrival_time,
            total_time_s=now - request.arrival_time,
        )
        return RequestOutput(request.req_id, token_ids, text, request.finish_reason, request.error, stats)


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread and streams each request's outputs.

    Every public method is safe to call from the event loop; each takes the engine lock only for
    bookkeeping, never across a model step.
    """

    def __init__(self, engine: LLMEngine, on_failure: Callable[[str], None] | None = None):
        """Args:
            engine: the engine to run.
            on_failure: called once, from the engine thread, with the reason when a model step fails.
        """
        self.engine = engine
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._executing = False  # a scheduled step is running on the model, outside the lock
        self._deferred_aborts: list[str] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    def start(self) -> None:
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

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        with self._lock:
            return self.engine.cached_prefix_len(token_ids)

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
        # Model steps are batch work: on a shared host, the service's own I/O, a router and its
        # clients wake up ahead of them, so probes and tokens do not wait behind a step.
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
                sampled = self.engine.executor.execute(output)
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
