"""The engine: scheduler + model executor + detokenization.

``LLMEngine`` is synchronous and single-threaded; ``tandem.engine.async_engine`` streams it to asyncio.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.engine.block_pool import CacheFeed, CachedPrefix
from tandem.engine.config import SchedulerConfig
from tandem.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from tandem.errors import EngineDeadError, InvalidRequestError
from tandem.engine.rates import Rates, RateTracker, StepSample
from tandem.engine.request import FinishReason, Request, RequestStatus, Sample, TokenLogprobs
from tandem.engine.scheduler import SchedulerLoad, Scheduler, SchedulerOutput
from tandem.structured import Grammars


class ModelExecutor(Protocol):
    """What the engine needs from a model runner."""

    device: str
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    mask_seconds_per_row: float  # a structured output's mask, per row, averaged over recent steps
    small_step_rows: int  # steps of at most this many rows run another way, priced apart (0: none do)

    def execute(self, output: SchedulerOutput) -> list[Sample | None]:
        """Run one step; return the sample per scheduled request (None where none is sampled)."""

    def take_mask_seconds(self) -> float:
        """The seconds the last step spent masking structured outputs."""


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
    """One item of a request's stream: new tokens and text (with each token's log-probabilities if the request
    asked for them), and on the last item how it ended."""

    req_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    stats: RequestStats | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

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
        self.rates = RateTracker(config.max_num_batched_tokens, config.max_active_requests,
                                 small_step_rows=executor.small_step_rows)
        self.seq = 0
        self.dead_reason: str | None = None
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self._grammars: Grammars | None = None

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
        self.constrain(request)
        self.scheduler.add_request(request)
        self._requests[request.req_id] = request
        self._detokenizers[request.req_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.stop_strings, request.include_stop_string,
            request.skip_special_tokens)
        self.seq += 1

    def constrain(self, request: Request) -> None:
        """Give a request with a structured output its constraint, compiling its grammar for this model's
        tokenizer on first use of the spec (milliseconds; ``AsyncEngine`` calls this off its event loop)."""
        spec = request.sampling.structured_output
        if spec is None or request.constraint is not None:
            return
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.executor.vocab_size, self.executor.eos_token_ids)
        request.constraint = self._grammars.constraint(spec)

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

    def process(self, output: SchedulerOutput, sampled: Sequence[Sample | None], seconds: float,
                record_step: Callable[[StepSample], None] | None = None) -> list[RequestOutput]:
        """Account for an executed step: record its time, append tokens, detokenize, check stops.

        Args:
            output: the step's schedule.
            sampled: what the executor returned for it.
            seconds: how long the step took.
            record_step: where the step's time goes; by default the rates' observed steps.
        """
        masking = self.executor.take_mask_seconds()  # priced per constrained row, apart from the fit
        (record_step or self.rates.observe)(StepSample(output.num_prefill_tokens, output.num_decode_requests,
                                                       seconds - masking))
        tokens = [None if sample is None else sample.token_id for sample in sampled]
        logprobs = {}
        for item, sample in zip(output.scheduled, sampled):
            if sample is not None and sample.logprobs is not None:
                logprobs[item.request.req_id] = (sample.logprobs,)
            if sample is not None and item.request.wants_prompt_logprobs:
                collected = self._prompt_logprobs.setdefault(item.request.req_id, [])
                del collected[sample.prompt_start:]  # a prefill restarted after preemption computes them again
                collected.extend(sample.prompt_logprobs)
        outputs = []
        for request in self.scheduler.update_from_output(output, tokens, self._check_stop):
            token_ids = (request.token_ids[-1],)
            text = self._detokenizers[request.req_id].release()
            token_logprobs = logprobs.get(request.req_id, ())
            prompt_logprobs = tuple(self._prompt_logprobs.pop(request.req_id, ()))
            if request.status.is_finished:
                outputs.append(self._final_output(request, token_ids, text, token_logprobs, prompt_logprobs))
            else:
                outputs.append(RequestOutput(request.req_id, token_ids, text, logprobs=token_logprobs,
                                             prompt_logprobs=prompt_logprobs))
        self.seq += 1
        return outputs

    def step(self, record_step: Callable[[StepSample], None] | None = None) -> list[RequestOutput]:
        """Schedule, execute and process one step (synchronous use); ``record_step`` as in ``process``."""
        output = self.schedule()
        if not output.scheduled:
            return []
        start = time.perf_counter()
        sampled = self.execute(output)
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

        measure(min(64, self.config.max_num_batched_tokens), 1, 0)  # warm-up: first-call allocations are not a rate
        prefill_only, first_decode = 0, 1
        for prefill_tokens, decodes in self.rates.calibration_steps():
            # a prompt's prefill alone, or the first decode step of ``decodes`` requests after 16-token prompts
            shape = (prefill_tokens, 1, prefill_only) if prefill_tokens else (16, decodes, first_decode)
            samples = [measure(*shape) for _ in range(repeats)]
            self.rates.add_calibration(min(samples, key=lambda sample: sample.seconds))
        self.reset_prefix_cache()
        return self.current_rates()

    def current_rates(self) -> Rates:
        """The fitted step-time model, with the measured cost of a constrained row's mask."""
        return dataclasses.replace(self.rates.rates(),
                                   step_per_constrained_row_s=self.executor.mask_seconds_per_row)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only while no request holds blocks)."""
        self.scheduler.reset_prefix_cache()

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        return self.scheduler.cached_prefix(token_ids)

    def follow_prefix_cache(self) -> CacheFeed:
        return self.scheduler.follow_prefix_cache()

    def prefix_cache_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]:
        return self.scheduler.prefix_cache_changes(feed)

    def unfollow_prefix_cache(self, feed: CacheFeed) -> None:
        self.scheduler.unfollow_prefix_cache(feed)

    def execute(self, output: SchedulerOutput) -> list[Sample | None]:
        """Run the model on a scheduled batch; the sampled tokens go to ``process``. Touches no engine state,
        so the engine loop calls it outside its lock."""
        return self.executor.execute(output)

    def state(self) -> EngineState:
        return EngineState(
            seq=self.seq,
            healthy=self.healthy,
            device=self.executor.device,
            max_active_requests=self.config.max_active_requests,
            block_size=self.config.block_size,
            load=self.scheduler.load(),
            rates=self.current_rates() if self.rates.calibrated else None,
        )

    def _validate(self, request: Request) -> None:
        if request.req_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.req_id!r} is already in use")
        validate_request(request, self.executor.vocab_size, self.executor.max_model_len,
                         self.scheduler.num_kv_blocks, self.config.block_size)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Detokenize the request's new token (``process`` releases its text); return the status it ends with."""
        token = request.token_ids[-1]
        detokenizer = self._detokenizers[request.req_id]
        may_stop = request.num_output_tokens >= request.sampling.min_tokens
        detokenizer.push(token, find_stops=may_stop)
        if not may_stop:
            return RequestStatus.FINISHED_LENGTH if request.decode_budget <= 0 else None
        if detokenizer.stopped or token in request.stop_token_ids:
            return RequestStatus.FINISHED_STOP
        if not request.ignore_eos and token in self.executor.eos_token_ids:
            return RequestStatus.FINISHED_EOS
        if request.constraint is not None and request.constraint.complete:
            return RequestStatus.FINISHED_STOP
        if request.decode_budget <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _final_output(self, request: Request, token_ids: tuple[int, ...], text: str = "",
                      logprobs: tuple[TokenLogprobs, ...] = (),
                      prompt_logprobs: tuple[TokenLogprobs, ...] = ()) -> RequestOutput:
        del self._requests[request.req_id]
        self._prompt_logprobs.pop(request.req_id, None)
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
        return RequestOutput(request.req_id, token_ids, text, request.finish_reason, request.error, stats, logprobs,
                             prompt_logprobs)


def validate_request(request: Request, vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int) -> None:
    """Check a request against a model's vocabulary and context and a KV cache's size (any engine's).

    Raises:
        InvalidRequestError: naming the field, as the worker API spells it.
    """
    if not request.prompt_token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    for token in request.prompt_token_ids:
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError("prompt_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
    if not isinstance(request.max_new_tokens, int) or request.max_new_tokens <= 0:
        raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {request.max_new_tokens!r}")
    total = request.num_prompt_tokens + request.max_new_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt ({request.num_prompt_tokens} tokens) + max_new_tokens ({request.max_new_tokens}) "
            f"exceeds the context length {max_model_len}",
        )
    if request.max_num_blocks(block_size) > num_kv_blocks:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt + max_new_tokens ({total} tokens) exceeds the KV cache ({num_kv_blocks * block_size} tokens)",
        )
    for token in request.stop_token_ids:
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError("stop_token_ids", f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
    for field, tokens in (("logit_bias", request.sampling.logit_bias), ("allowed_token_ids",
                                                                         request.sampling.allowed_token_ids)):
        for token in tokens:
            if token >= vocab_size:
                raise InvalidRequestError(f"sampling.{field}", f"token id {token} is outside the vocabulary [0, {vocab_size})")
    if request.sampling.min_tokens > request.max_new_tokens:
        raise InvalidRequestError("sampling.min_tokens", f"must be at most max_new_tokens ({request.max_new_tokens}), "
                                                         f"got {request.sampling.min_tokens}")
