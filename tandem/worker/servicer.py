"""The tandem.v1.Worker servicer: converts messages and calls the engine; errors map to status codes here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid

import grpc

from tandem.engine.block_pool import FREE, HELD, REMOVED, CachedPrefix
from tandem.engine.engine import EngineState, RequestOutput
from tandem.errors import EngineDeadError, InvalidRequestError, QueueFullError
from tandem.engine.rates import Rates
from tandem.engine.request import FinishReason, Request
from tandem.protocol import WORKER_KINDS, checked_sampling_params, logprobs_messages, prompt_token_ids
from tandem.sampling import check_samples
from tandem.streams import merged
from tandem.telemetry import child_span, server_span, tracer, wall_time_ns
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tandem.worker import metrics
from tandem.worker.engines import WorkerEngine, WorkerIdentity

logger = logging.getLogger(__name__)
_tracer = tracer("tandem.worker")
_record_generate_status = metrics.rpc_status_recorder("Generate")

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MIN_WATCH_INTERVAL_S = 0.01
MAX_WATCH_INTERVAL_S = 60.0
WATCH_COALESCE_S = 0.01
MAX_HASHES_PER_MESSAGE = 65536  # about 1.2 MB of hashes, well inside a receiver's default 4 MiB message limit

_FINISH_REASONS = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
}

# The engine's errors and their status codes: the one mapping every RPC here uses (see _abort_for).
_STATUS_CODES = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineDeadError: grpc.StatusCode.UNAVAILABLE,
}
_ENGINE_ERRORS = tuple(_STATUS_CODES)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one engine. Until ``attach`` it answers UNAVAILABLE (starting); ``drain`` refuses new work."""

    def __init__(self, kind: str):
        self.kind = kind
        self.serving_state = common_pb2.SERVING_STATE_STARTING
        self.engine: WorkerEngine | None = None
        self.identity: WorkerIdentity | None = None
        self.tokenizer = None
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(self, engine: WorkerEngine, identity: WorkerIdentity, tokenizer) -> None:
        self.engine, self.identity, self.tokenizer = engine, identity, tokenizer
        self.serving_state = common_pb2.SERVING_STATE_SERVING

    def drain(self) -> None:
        if self.serving_state == common_pb2.SERVING_STATE_SERVING:
            self.serving_state = common_pb2.SERVING_STATE_DRAINING

    def mark_failed(self) -> None:
        self.serving_state = common_pb2.SERVING_STATE_FAILED

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate stream is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with server_span(_tracer, "tandem.v1.Worker/Generate", context,
                         {"gen_ai.request.max_tokens": request.max_new_tokens},
                         on_status=_record_generate_status) as span:
            engine = await self._require_state(context, common_pb2.SERVING_STATE_SERVING)
            samples = await self._to_engine_requests(request, context)
            engine_request = samples[0]
            span.set_attributes({"tandem.request_id": engine_request.req_id,
                                 "gen_ai.usage.input_tokens": engine_request.num_prompt_tokens})
            self._inflight += 1
            self._idle.clear()
            headers = _HeadersFirst(context)
            streams = [engine.generate(sample, on_queued=headers.sample_queued) for sample in samples]
            try:
                async with contextlib.aclosing(merged(streams)) as outputs:
                    async for index, output in outputs:
                        if output.finish_reason is FinishReason.ERROR:  # the engine failed and ended every request
                            raise EngineDeadError(output.error)
                        if output.finish_reason is FinishReason.ABORTED:
                            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                                "worker shut down before the request finished")
                        if output.finished:
                            if not index:
                                _record_engine_phases(span, engine_request, output)
                            metrics.record_finished(output)
                        yield _to_response(engine_request.req_id, output, index)
            except _ENGINE_ERRORS as exc:
                await _abort_for(context, exc)
            finally:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.set()

    async def Estimate(self, request: worker_pb2.EstimateRequest, context: grpc.aio.ServicerContext):
        return self._estimate(await self._require_state(context), request)

    async def EstimateStream(self, requests, context: grpc.aio.ServicerContext):
        engine = await self._require_state(context)
        async for request in requests:
            yield self._estimate(engine, request)

    def _estimate(self, engine: WorkerEngine, request: worker_pb2.EstimateRequest) -> common_pb2.BackendState:
        metrics.ESTIMATES.inc()
        return self._state_message(engine.state(), engine.cached_prefix(list(request.prompt_token_ids)))

    async def WatchState(self, request: worker_pb2.WatchStateRequest, context: grpc.aio.ServicerContext):
        interval = request.interval_s or 1.0
        if not math.isfinite(interval) or not MIN_WATCH_INTERVAL_S <= interval <= MAX_WATCH_INTERVAL_S:
            await _abort_for(context, InvalidRequestError(
                "interval_s", f"must be 0 or within [{MIN_WATCH_INTERVAL_S}, {MAX_WATCH_INTERVAL_S}], got {interval!r}"))
        engine = await self._require_state(context)
        feed = engine.follow_prefix_cache() if request.prefix_cache_changes else None
        try:
            while True:
                state = engine.state()
                if feed is None:
                    yield self._state_message(state, CachedPrefix(0, 0))
                else:
                    for changes in _prefix_cache_messages(*engine.prefix_cache_changes(feed)):
                        yield self._state_message(state, CachedPrefix(0, 0), changes)
                sent_at = time.monotonic()
                await engine.wait_for_change(state.seq, interval)
                # A change after a quiet spell goes out at once; in a busy one, at most one snapshot per period.
                await asyncio.sleep(max(0.0, WATCH_COALESCE_S - (time.monotonic() - sent_at)))
        finally:
            if feed is not None:
                engine.unfollow_prefix_cache(feed)

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext):
        engine = await self._require_state(context)
        identity = self.identity
        state = engine.state()
        return worker_pb2.GetInfoResponse(
            model_id=identity.model_id,
            model_fingerprint=identity.model_fingerprint,
            device=state.device,
            dtype=identity.dtype,
            kind=WORKER_KINDS[identity.kind],
            max_active_requests=state.max_active_requests,
            max_waiting_requests=identity.max_waiting_requests,
            max_num_batched_tokens=identity.max_num_batched_tokens,
            max_prefill_step_tokens=identity.max_prefill_step_tokens,
            block_size=state.block_size,
            kv_blocks_total=state.load.num_kv_blocks,
            context_length=identity.context_length,
            vocab_size=identity.vocab_size,
            eos_token_ids=identity.eos_token_ids,
            rates=_rates_message(state.rates),
            version=identity.version,
            engine=identity.engine,
            engine_version=identity.engine_version,
        )

    async def _require_state(self, context: grpc.aio.ServicerContext, state: int | None = None) -> WorkerEngine:
        """The engine, or abort UNAVAILABLE while starting (or, for new work, while not serving)."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is starting: the model is loading or calibrating")
        if state is not None and self.serving_state != state:
            reason = "draining" if self.serving_state == common_pb2.SERVING_STATE_DRAINING else "failed"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker is {reason} and accepts no new requests")
        return self.engine

    async def _to_engine_requests(self, message: worker_pb2.GenerateRequest, context) -> list[Request]:
        """The request's samples (``Request.samples``): one unless it asks for ``n``."""
        try:
            return (await self._parse_request(message)).samples(check_samples(message.n or 1))
        except InvalidRequestError as exc:
            await _abort_for(context, exc)

    async def _parse_request(self, message: worker_pb2.GenerateRequest) -> Request:
        request_id = message.request_id or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
        prompt = await prompt_token_ids(message, self.tokenizer)
        if len(message.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for stop in message.stop:
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return Request(
            req_id=request_id,
            prompt_token_ids=prompt,
            max_new_tokens=message.max_new_tokens,
            sampling=await checked_sampling_params(message.sampling),
            ignore_eos=message.ignore_eos,
            stop_token_ids=frozenset(message.stop_token_ids),
            stop_strings=tuple(message.stop),
            include_stop_string=message.include_stop_string,
            skip_special_tokens=not message.keep_special_tokens,
        )

    def _state_message(self, state: EngineState, cached: CachedPrefix,
                       prefix_cache_changes: common_pb2.PrefixCacheChanges | None = None) -> common_pb2.BackendState:
        load = state.load
        serving_state = self.serving_state if state.healthy else common_pb2.SERVING_STATE_FAILED
        return common_pb2.BackendState(
            cached_tokens=cached.tokens,
            cached_tokens_evictable=cached.evictable_tokens,
            pending_prefill_tokens=state.pending_prefill_tokens,
            pending_decode_tokens=state.pending_decode_budget,
            running_prefill_tokens=load.running_prefill_tokens,
            running_decode_tokens=load.running_decode_budget,
            waiting_prefill_tokens=load.waiting_prefill_tokens,
            waiting_decode_tokens=load.waiting_decode_budget,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            max_active_requests=state.max_active_requests,
            max_waiting_requests=self.identity.max_waiting_requests,
            kv_blocks_total=load.num_kv_blocks,
            kv_blocks_used=load.num_used_blocks,
            kv_blocks_cached=load.num_cached_free_blocks,
            block_size=state.block_size,
            prefix_cache_queried_tokens=load.prefix_queried_tokens,
            prefix_cache_hit_tokens=load.prefix_hit_tokens,
            rates=_rates_message(state.rates),
            seq=state.seq,
            device=state.device,
            kind=WORKER_KINDS[self.kind],
            serving_state=serving_state,
            timestamp_s=time.time(),
            prefix_cache_changes=prefix_cache_changes,
            engine=self.identity.engine,
            engine_version=self.identity.engine_version,
            requests=[
                common_pb2.RequestLoad(
                    request_id=r.req_id, running=r.running, prefill_tokens=r.prefill_tokens, decode_tokens=r.decode_budget,
                    cached_tokens=r.cached_tokens, constrained=r.constrained,
                )
                for r in load.requests
            ],
        )


async def _abort_for(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with the status code of the engine error ``exc`` (see _STATUS_CODES)."""
    code = next(code for error, code in _STATUS_CODES.items() if isinstance(exc, error))
    details = f"worker engine failed: {exc}" if isinstance(exc, EngineDeadError) else str(exc)
    await context.abort(code, details)


class _HeadersFirst:
    """Sends a call's headers once its first sample is queued, so a proxy learns the call was taken before any
    token, and holds every sample's outputs until they are out: a call takes one write at a time, and an output
    written while the headers are in flight fails the whole call.
    """

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context
        self._sending = False
        self._sent = asyncio.Event()

    async def sample_queued(self) -> None:
        if not self._sending:
            self._sending = True
            await self._context.send_initial_metadata(())
            self._sent.set()
        await self._sent.wait()


def _to_response(request_id: str, output: RequestOutput, index: int = 0) -> worker_pb2.GenerateResponse:
    response = worker_pb2.GenerateResponse(request_id=request_id, token_ids=output.token_ids, text=output.text,
                                           logprobs=logprobs_messages(output.logprobs),
                                           prompt_logprobs=logprobs_messages(output.prompt_logprobs), index=index)
    if output.finished:
        stats = output.stats
        response.result.CopyFrom(
            worker_pb2.GenerateResult(
                finish_reason=_FINISH_REASONS[output.finish_reason],
                usage=common_pb2.Usage(
                    prompt_tokens=stats.num_prompt_tokens,
                    cached_tokens=stats.num_cached_tokens,
                    output_tokens=stats.num_output_tokens,
                    preemptions=stats.num_preemptions,
                ),
                timings=common_pb2.Timings(
                    queue_time_s=stats.queue_time_s, ttft_s=stats.ttft_s or 0.0, total_time_s=stats.total_time_s
                ),
            )
        )
    return response


def _record_engine_phases(span, request: Request, output: RequestOutput) -> None:
    """Engine spans under the worker's server span, timed from the request's recorded timestamps."""
    stats = output.stats
    span.set_attributes({
        "gen_ai.usage.output_tokens": stats.num_output_tokens,
        "gen_ai.response.finish_reasons": [output.finish_reason.value],
        "tandem.cached_tokens": stats.num_cached_tokens,
    })
    arrival = request.arrival_time
    scheduled = arrival + stats.queue_time_s
    end = arrival + stats.total_time_s
    child_span(_tracer, span, "engine.queue", start_time=wall_time_ns(arrival)).end(end_time=wall_time_ns(scheduled))
    if stats.ttft_s is None:
        return
    first_token = arrival + stats.ttft_s
    prefill = child_span(_tracer, span, "engine.prefill", start_time=wall_time_ns(scheduled), attributes={
        "tandem.cached_tokens": stats.num_cached_tokens,
        "tandem.computed_tokens": stats.num_prompt_tokens - stats.num_cached_tokens,
    })
    prefill.end(end_time=wall_time_ns(first_token))
    decode = child_span(_tracer, span, "engine.decode", start_time=wall_time_ns(first_token),
                        attributes={"gen_ai.usage.output_tokens": stats.num_output_tokens})
    decode.add_event("first_token", timestamp=wall_time_ns(first_token))
    decode.end(end_time=wall_time_ns(end))


def _prefix_cache_messages(reset: bool, changes: dict[bytes, str],
                           limit: int = MAX_HASHES_PER_MESSAGE) -> list[common_pb2.PrefixCacheChanges]:
    """The changes as one message, or as several of at most ``limit`` hashes, each but the last ``continued``."""
    items = list(changes.items())
    messages = []
    for start in range(0, max(1, len(items)), limit):
        lists = {HELD: [], FREE: [], REMOVED: []}
        for block_hash, standing in items[start:start + limit]:
            lists[standing].append(block_hash)
        messages.append(common_pb2.PrefixCacheChanges(reset=reset and start == 0, continued=start + limit < len(items),
                                                      held=lists[HELD], free=lists[FREE], removed=lists[REMOVED]))
    return messages


def _rates_message(rates: Rates | None) -> common_pb2.Rates | None:
    if rates is None:
        return None
    return common_pb2.Rates(
        prefill_tokens_per_s=rates.prefill_tok_s,
        decode_tokens_per_s=rates.decode_tok_s,
        step_base_s=rates.step_base_s,
        step_per_prefill_token_s=rates.step_per_prefill_token_s,
        step_per_decode_s=rates.step_per_decode_s,
        reference_prefill_tokens=rates.reference_prefill_tokens,
        reference_decode_batch=rates.reference_decode_batch,
        calibration_steps=rates.num_calibration_steps,
        observed_steps=rates.num_observed_steps,
        source=rates.source,
        step_per_constrained_row_s=rates.step_per_constrained_row_s,
        small_step_rows=rates.small_step_rows,
        small_step_base_s=rates.small_step_base_s,
        small_step_per_row_s=rates.small_step_per_row_s,
    )
