"""vLLM's ``AsyncLLM`` behind the interface a Tandem worker serves (``tandem.worker.engine.WorkerEngine``).

What vLLM does not report per request, the worker tracks from what it sends and streams:
- each request's prompt, cached tokens (``num_cached_tokens``, estimated from the prefix index until the
  first output) and remaining decode budget;
- which requests run: vLLM's scheduler admits in arrival order, so the first ``num_running_reqs`` (from
  its per-step ``SchedulerStats``) of the requests still in flight, and any that has streamed a token.

Counts, KV usage and prefix-cache totals come from a stat logger that vLLM calls once per engine step; its
iteration details (prefill tokens, decode rows, seconds) feed the same step-time model Tandem's engine fits.
The prefix index comes from vLLM's KV events (``tandem.vllm_engine.kv_events``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import vllm
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from tandem.engine.block_pool import CacheFeed, CachedPrefix
from tandem.engine.engine import EngineState, RequestOutput, RequestStats, validate_request
from tandem.errors import EngineDeadError, InvalidRequestError, QueueFullError
from tandem.engine.rates import RateTracker, StepSample
from tandem.engine.request import FinishReason, Request, TokenLogprobs
from tandem.engine.scheduler import RequestLoad, SchedulerLoad
from tandem.structured import StructuredOutput
from tandem.vllm_engine.kv_events import KVEventStream
from tandem.vllm_engine.prefix_index import VllmPrefixIndex

logger = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
KV_EVENTS_TOPIC = "kv"

_FINISH_REASONS = {"length": FinishReason.LENGTH, "abort": FinishReason.ABORTED, "error": FinishReason.ERROR}


@dataclass(frozen=True)
class VllmSettings:
    """How the worker builds its vLLM engine.

    Args:
        model_dir: a Hugging Face model directory.
        device: "cpu" or "cuda[:N]".
        dtype: None for vLLM's choice ("auto").
        max_num_seqs: requests in the running batch (Tandem's ``--max-active``).
        max_num_batched_tokens: tokens per engine step.
        max_waiting_requests: requests the worker queues beyond the running batch.
        block_size: tokens per KV block.
        kv_cache_bytes: memory for the KV cache; ignored when ``num_kv_blocks`` is set.
        num_kv_blocks: exact number of KV blocks, or None.
        cpu_threads: on the CPU, the cores vLLM's OpenMP threads are bound to (their number).
        extra_args: further ``AsyncEngineArgs`` fields, as given with ``--vllm-args``.
    """

    model_dir: Path
    device: str
    dtype: str | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    block_size: int
    kv_cache_bytes: int
    num_kv_blocks: int | None = None
    cpu_threads: int | None = None
    extra_args: dict = field(default_factory=dict)


@dataclass(eq=False)
class _Tracked:
    """What the worker knows of one request in vLLM."""

    request: Request
    block_hashes: list[bytes]
    cache_estimate: int
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    holding: bool = False
    prompt_computed: asyncio.Event = field(default_factory=asyncio.Event)  # for samples sharing its prompt

    @property
    def decode_budget(self) -> int:
        return self.request.max_new_tokens - self.num_output_tokens


class VllmEngine:
    """One ``AsyncLLM`` and the worker's account of it. Every method runs on the worker's event loop."""

    name = ENGINE_NAME
    version = vllm.__version__

    def __init__(self, settings: VllmSettings, on_failure: Callable[[str], None] | None = None,
                 on_step: Callable[[int], None] | None = None):
        """Start vLLM (slow: loads the model and warms it up; call it off the event loop). ``on_step`` gets the
        number of requests of every step vLLM runs after calibration."""
        self.settings = settings
        self._on_failure = on_failure
        self._on_step = on_step
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tandem-vllm-")
        self._kv_endpoint = f"ipc://{self._socket_dir.name}/kv-events"
        self._kv_replay_endpoint = f"ipc://{self._socket_dir.name}/kv-replay"
        if settings.device == "cpu" and settings.cpu_threads and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))[:settings.cpu_threads]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        args = AsyncEngineArgs(**{
            "model": str(settings.model_dir),
            "dtype": settings.dtype or "auto",
            "block_size": settings.block_size,
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "enable_prefix_caching": True,
            "kv_cache_memory_bytes": None if settings.num_kv_blocks else settings.kv_cache_bytes,
            "num_gpu_blocks_override": settings.num_kv_blocks,
            "enable_logging_iteration_details": True,
            "disable_log_stats": True,
            "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic=KV_EVENTS_TOPIC,
                                               endpoint=self._kv_endpoint, replay_endpoint=self._kv_replay_endpoint),
            **settings.extra_args,
        })
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[lambda config, index: _StepRecorder(self)])
        model_config = self.llm.vllm_config.model_config
        cache_config = self.llm.vllm_config.cache_config
        self.device = settings.device
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.block_size = cache_config.block_size
        self.num_kv_blocks = cache_config.num_gpu_blocks
        scheduler_config = self.llm.vllm_config.scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.rates = RateTracker(self.max_num_batched_tokens, self.max_num_seqs)
        self.index = VllmPrefixIndex(self.block_size, feed_limit=2 * self.num_kv_blocks + 1024)
        self.seq = 0
        self._requests: dict[str, _Tracked] = {}
        self._num_running_reported = 0
        self._kv_cache_usage = 0.0
        self._prefix_queried_tokens = 0
        self._prefix_hit_tokens = 0
        self._calibration_steps: list[StepSample] | None = None
        self._changed = asyncio.Event()
        self._failure: str | None = None
        self._events: KVEventStream | None = None

    async def start(self) -> None:
        """Follow vLLM's KV events, then calibrate the step-time model on the real device."""
        self._events = KVEventStream(self.index, self._kv_endpoint, self._kv_replay_endpoint, KV_EVENTS_TOPIC,
                                     on_lost=self._resync_prefix_cache, on_applied=self._bump)
        self._events.start()
        await self.calibrate()

    async def close(self) -> None:
        """Stop following the KV events and shut vLLM down; requests still in flight end."""
        if self._events is not None:
            await self._events.close()
        await asyncio.to_thread(self.llm.shutdown)
        self._socket_dir.cleanup()

    @property
    def healthy(self) -> bool:
        return self._failure is None and not self.llm.errored

    async def generate(self, request: Request,
                       on_queued: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[RequestOutput]:
        """Send ``request`` to vLLM and yield its outputs until the last one (see ``AsyncEngine.generate``)."""
        tracked = self._check(request)
        self._requests[request.req_id] = tracked  # in arrival order: the order vLLM admits them in
        self._bump()
        outputs, finished = None, False
        try:
            if request.shares_prompt_with is not None:  # its blocks come from vLLM's prefix cache once computed
                first = self._requests.get(request.shares_prompt_with.req_id)
                if first is not None:
                    await first.prompt_computed.wait()
            outputs = await self.llm.add_request(request.req_id, {"prompt_token_ids": request.prompt_token_ids},
                                                 _vllm_sampling(request))
            if on_queued is not None:
                await on_queued()
            while not finished:
                output = outputs.get_nowait() or await outputs.get()
                result = self._account(tracked, output)
                finished = result.finished
                yield result
        except VllmEngineDeadError:
            raise self._died() from None
        finally:
            if outputs is not None and not finished and not self.llm.errored:
                await self.llm.abort(outputs.request_id, internal=True)
            self._forget(tracked)

    def _check(self, request: Request) -> _Tracked:
        """Validate ``request`` as Tandem's engine does; its record, not yet tracked."""
        if not self.healthy:
            raise EngineDeadError(self._failure or "vLLM's engine is not running")
        if request.req_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.req_id!r} is already in use")
        validate_request(request, self.vocab_size, self.max_model_len, self.num_kv_blocks, self.block_size)
        if self._load().num_waiting >= self.settings.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.settings.max_waiting_requests} requests)")
        hashes = self.index.prompt_hashes(request.prompt_token_ids)
        return _Tracked(request, hashes, self.index.cached_prefix(request.prompt_token_ids, hashes).tokens)

    def _account(self, tracked: _Tracked, output) -> RequestOutput:
        """The Tandem output for one of vLLM's delta outputs of ``tracked``."""
        completion = output.outputs[0]
        now = time.monotonic()
        if tracked.first_token_time is None and completion.token_ids:
            tracked.first_token_time = now
            tracked.prompt_computed.set()
        tracked.num_output_tokens += len(completion.token_ids)
        tracked.num_cached_tokens = output.num_cached_tokens or 0
        if tracked.first_token_time is not None:
            self._hold(tracked)
        self._bump()
        logprobs = _logprobs(completion.token_ids, completion.logprobs, tracked.request.sampling.logprobs)
        prompt_logprobs = ()
        if output.prompt_logprobs:  # all of them, once (vLLM hands out [] after)
            prompt_logprobs = _logprobs(output.prompt_token_ids[1:], output.prompt_logprobs[1:],
                                        tracked.request.sampling.prompt_logprobs)
        if not output.finished:
            return RequestOutput(tracked.request.req_id, tuple(completion.token_ids), completion.text,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        request = tracked.request
        metrics = output.metrics
        arrival = request.arrival_time
        queue_time = max(0.0, metrics.scheduled_ts - metrics.queued_ts) if metrics and metrics.scheduled_ts else 0.0
        ttft = None if tracked.first_token_time is None else tracked.first_token_time - arrival
        stats = RequestStats(
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=tracked.num_cached_tokens,
            num_output_tokens=tracked.num_output_tokens,
            num_preemptions=metrics.num_preemptions if metrics else 0,
            queue_time_s=min(queue_time, ttft if ttft is not None else now - arrival),
            ttft_s=ttft,
            total_time_s=now - arrival,
        )
        return RequestOutput(request.req_id, tuple(completion.token_ids), completion.text,
                             _finish_reason(completion), None, stats, logprobs, prompt_logprobs)

    def _forget(self, tracked: _Tracked) -> None:
        tracked.prompt_computed.set()  # a sample waiting on it computes the prompt itself
        if self._requests.pop(tracked.request.req_id, None) is None:
            return
        if tracked.holding:
            self.index.release(tracked.block_hashes)
        self._mark_running()
        self._bump()

    def _mark_running(self) -> None:
        """Hold the prompt blocks of the requests that now run (see the module's docstring)."""
        running = self._num_running_reported
        for position, tracked in enumerate(self._requests.values()):
            if position < running or tracked.first_token_time is not None:
                self._hold(tracked)

    def _hold(self, tracked: _Tracked) -> None:
        if not tracked.holding:
            tracked.holding = True
            self.index.hold(tracked.block_hashes)

    def _load(self) -> SchedulerLoad:
        requests = []
        for tracked in self._requests.values():
            prompt = tracked.request.num_prompt_tokens
            if tracked.holding:
                prefill = 0 if tracked.first_token_time is not None else prompt - tracked.cache_estimate
                requests.append(RequestLoad(tracked.request.req_id, True, prefill, tracked.decode_budget,
                                            constrained=tracked.request.constrained))
            else:
                requests.append(RequestLoad(tracked.request.req_id, False, prompt - tracked.cache_estimate,
                                            tracked.decode_budget, tracked.cache_estimate, tracked.request.constrained))
        used = round(self._kv_cache_usage * self.num_kv_blocks) if self._requests else 0
        return SchedulerLoad(
            requests=tuple(sorted(requests, key=lambda load: not load.running)),
            num_kv_blocks=self.num_kv_blocks,
            num_used_blocks=used,
            num_cached_free_blocks=min(self.index.num_cached_free_blocks, self.num_kv_blocks - used),
            prefix_queried_tokens=self._prefix_queried_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )

    def state(self) -> EngineState:
        if self._failure is None and self.llm.errored:
            self._fail("vLLM's engine stopped")
        return EngineState(
            seq=self.seq,
            healthy=self.healthy,
            device=self.device,
            max_active_requests=self.max_num_seqs,
            block_size=self.block_size,
            load=self._load(),
            rates=self.rates.rates() if self.rates.calibrated else None,
        )

    async def wait_for_change(self, seq: int, timeout: float) -> None:
        if self.seq != seq:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def cached_prefix(self, token_ids) -> CachedPrefix:
        return self.index.cached_prefix(token_ids)

    def follow_prefix_cache(self) -> CacheFeed:
        return self.index.subscribe()

    def prefix_cache_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        return self.index.take_changes(feed)

    def unfollow_prefix_cache(self, feed: CacheFeed) -> None:
        self.index.unsubscribe(feed)

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()
        self.index.clear()
        self._bump()

    async def calibrate(self, repeats: int = 3) -> None:
        """Time the step shapes Tandem's engine calibrates on (``LLMEngine.calibrate``) through vLLM itself."""
        rng = random.Random(0)
        budget, batch = self.max_num_batched_tokens, self.max_num_seqs
        counter = iter(range(1 << 30))

        async def run(prompt_len: int, num_requests: int) -> list[StepSample]:
            self._calibration_steps = []
            params = VllmSamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False,
                                        output_kind=RequestOutputKind.FINAL_ONLY)

            async def one() -> None:
                prompt = [rng.randrange(self.vocab_size) for _ in range(prompt_len)]
                async for _ in self.llm.generate({"prompt_token_ids": prompt}, params,
                                                 request_id=f"calibration-{next(counter)}"):
                    pass

            await asyncio.gather(*(one() for _ in range(num_requests)))
            steps, self._calibration_steps = self._calibration_steps, None
            return steps

        await run(min(64, budget), 1)  # warm-up
        shapes = [(max(1, budget // 2), 1, True), (budget, 1, True), (16, batch, False), (16, 1, False)]
        for prompt_len, num_requests, prefill in shapes:
            samples = []
            for _ in range(repeats):
                steps = await run(prompt_len, num_requests)
                # vLLM may admit concurrent requests over several steps: keep its widest pure step of the shape.
                if prefill:
                    samples += [s for s in steps if s.num_prefill_tokens > 0 and s.num_decode_requests == 0][:1]
                else:
                    samples += sorted((s for s in steps if s.num_prefill_tokens == 0),
                                      key=lambda s: -s.num_decode_requests)[:1]
            if samples:
                widest = max(s.num_decode_requests for s in samples)
                self.rates.add_calibration(min((s for s in samples if s.num_decode_requests == widest),
                                               key=lambda sample: sample.seconds))
        if not self.rates.calibrated:
            raise RuntimeError("vLLM reported no iteration details during calibration")
        await self.reset_prefix_cache()

    def record_step(self, scheduler_stats) -> None:
        """One engine step's ``SchedulerStats`` (called by ``_StepRecorder``)."""
        self._num_running_reported = scheduler_stats.num_running_reqs
        self._kv_cache_usage = scheduler_stats.kv_cache_usage
        prefix = scheduler_stats.prefix_cache_stats
        if prefix is not None:
            self._prefix_queried_tokens += prefix.queries
            self._prefix_hit_tokens += prefix.hits
        details = scheduler_stats.iteration_details
        if details is not None and not details.is_dummy:
            sample = StepSample(details.num_ctx_tokens, details.num_generation_requests, details.elapsed_ms / 1000)
            if self._calibration_steps is not None:
                self._calibration_steps.append(sample)
            else:
                self.rates.observe(sample)
                if self._on_step is not None:
                    self._on_step(details.num_ctx_requests + details.num_generation_requests)
        self._mark_running()
        self._bump()

    async def _resync_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    def _died(self) -> EngineDeadError:
        self._fail("vLLM's engine died")
        return EngineDeadError(self._failure)

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            if self._on_failure is not None:
                self._on_failure(reason)

    def _bump(self) -> None:
        self.seq += 1
        self._changed.set()
        self._changed = asyncio.Event()


class _StepRecorder(StatLoggerBase):
    """The stat logger vLLM calls once per engine step; it hands the scheduler's stats to the engine."""

    def __init__(self, engine: VllmEngine):
        self._engine = engine

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._engine.record_step(scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass


def _vllm_sampling(request: Request) -> VllmSamplingParams:
    sampling = request.sampling
    try:
        return VllmSamplingParams(
            max_tokens=request.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            min_p=sampling.min_p,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            min_tokens=sampling.min_tokens,
            logit_bias=dict(sampling.logit_bias) or None,
            allowed_token_ids=sorted(sampling.allowed_token_ids) or None,
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
            stop=list(request.stop_strings),
            include_stop_str_in_output=request.include_stop_string,
            skip_special_tokens=request.skip_special_tokens,
            stop_token_ids=sorted(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            structured_outputs=_vllm_structured_output(sampling.structured_output),
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:  # a value Tandem accepts and vLLM does not
        raise InvalidRequestError("sampling", f"vLLM refused it: {exc}") from None


def _vllm_structured_output(output: StructuredOutput | None) -> StructuredOutputsParams | None:
    """Tandem's structured output as vLLM's, held as Tandem's engine holds it: ``json_object`` to an object, JSON
    to one layout."""
    if output is None:
        return None
    if output.kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    key = {"json_schema": "json", "choice": "choice"}.get(output.kind, output.kind)
    return StructuredOutputsParams(**{key: list(output.spec) if output.kind == "choice" else output.spec},
                                   disable_any_whitespace=True)


def _logprobs(token_ids, positions, num_top: int | None) -> tuple[TokenLogprobs, ...]:
    """vLLM's log-probabilities of ``token_ids`` (a dict of token id -> Logprob per position: the token's own and
    the ``num_top`` most likely) as Tandem's."""
    if num_top is None or positions is None:
        return ()
    converted = []
    for token, position in zip(token_ids, positions):
        top = sorted(((other, entry.logprob) for other, entry in position.items()), key=lambda item: -item[1])
        own = position[token]
        converted.append(TokenLogprobs(token, own.logprob, own.rank, tuple(top[:num_top])))
    return tuple(converted)


def _finish_reason(completion) -> FinishReason:
    if completion.finish_reason == "stop":
        return FinishReason.EOS if completion.stop_reason is None else FinishReason.STOP
    return _FINISH_REASONS[completion.finish_reason]
