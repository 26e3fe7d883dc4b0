"""The tandem.v1.Router servicer: tokenize once, decide, proxy the worker's stream, fail over."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

import grpc
from opentelemetry.trace import SpanKind

from router_svc import metrics
from router_svc.admission import Admission, AdmissionRefused
from router_svc.backends import Backend, BackendRegistry, probe_all
from router_svc.policy import POLICIES, Decision, NoEligibleWorker, RouteInput, WorkerView
from tandem.engine.errors import InvalidRequestError
from tandem.protocol import WORKER_KINDS, sampling_params
from tandem.telemetry import child_span, mark_failed, outgoing_metadata, server_span, tracer
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)
_tracer = tracer("tandem.router")
_record_generate_status = metrics.rpc_status_recorder("Generate")
decision_log = logging.getLogger("tandem.router.decisions")

_CHAT_ROLES = ("system", "user", "assistant")
# Worker errors after which another worker may well succeed.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}


@dataclass(frozen=True)
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    policy: str
    worker_request: worker_pb2.GenerateRequest

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.worker_request.max_new_tokens


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, registry: BackendRegistry, tokenizer, default_policy: str, probe_deadline_s: float,
                 admission: Admission):
        self.registry = registry
        self.admission = admission
        self.tokenizer = tokenizer
        self.default_policy = default_policy
        self.probe_deadline_s = probe_deadline_s
        self._sequence = 0

    async def Generate(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):
        with server_span(_tracer, "tandem.v1.Router/Generate", context,
                         {"gen_ai.request.max_tokens": request.max_new_tokens},
                         on_status=_record_generate_status) as span:
            started = time.monotonic()
            first_token = True
            prepared = await self._prepare(request, context)
            span.set_attributes({"tandem.request_id": prepared.request_id,
                                 "gen_ai.usage.input_tokens": prepared.prompt_tokens})
            try:
                await self.admission.acquire()
            except AdmissionRefused as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            try:
                failed: list[str] = []
                errors: dict[str, str] = {}
                while True:
                    message = await self._decide(prepared, context, span, exclude=failed, errors=errors)
                    backend = self.registry.backends[message.chosen_worker]
                    self._sequence += 1
                    backend.dispatch(prepared.request_id, _uncached(message, prepared), prepared.max_new_tokens)
                    client = child_span(_tracer, span, "tandem.v1.Worker/Generate", SpanKind.CLIENT, {
                        "rpc.system": "grpc", "rpc.service": "tandem.v1.Worker", "rpc.method": "Generate",
                        "server.address": backend.address.host, "server.port": backend.address.port,
                        "tandem.worker": backend.name,
                    })
                    call = backend.stub.Generate(prepared.worker_request, timeout=context.time_remaining(),
                                                 metadata=outgoing_metadata(client))
                    streamed = 0
                    try:
                        try:  # the worker call is already under way while the decision goes out
                            yield router_pb2.RouteResponse(request_id=prepared.request_id, decision=message)
                        finally:  # bookkeeping, kept off the way to the first token
                            _log_decision(prepared.request_id, message)
                            metrics.record_decision(message)
                        async for response in call:
                            streamed += len(response.token_ids)
                            if first_token and response.token_ids:
                                metrics.TTFT.observe(time.monotonic() - started)
                                first_token = False
                            if response.HasField("result"):
                                _record_result(span, response.result)
                                metrics.E2E.observe(time.monotonic() - started)
                            yield router_pb2.RouteResponse(
                                request_id=prepared.request_id, token_ids=response.token_ids, text=response.text,
                                result=response.result if response.HasField("result") else None, worker=backend.name,
                            )
                        return
                    except grpc.aio.AioRpcError as exc:
                        code, details = exc.code(), exc.details()
                        mark_failed(client, exc)
                    except BaseException as exc:
                        mark_failed(client, exc)
                        raise
                    finally:
                        call.cancel()  # leaving the loop does not cancel a grpc.aio call
                        backend.release(prepared.request_id)
                        client.end()

                    backend.failed_requests += 1
                    if streamed or code not in _RETRYABLE:
                        if streamed:
                            await context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                f"worker {backend.name} failed after streaming {streamed} tokens ({code.name}: {details}); "
                                "the output is incomplete",
                            )
                        await context.abort(code, details)
                    logger.warning("worker %s failed before the first token (%s: %s); failing over", backend.name, code.name, details)
                    metrics.ROUTING_FAILOVERS.labels(backend.name).inc()
                    failed.append(backend.name)
                    errors[backend.name] = f"{code.name}: {details}"
            finally:
                self.admission.release()

    async def Explain(self, request: router_pb2.ExplainRequest, context: grpc.aio.ServicerContext):
        with server_span(_tracer, "tandem.v1.Router/Explain", context,
                         on_status=metrics.rpc_status_recorder("Explain")) as span:
            prepared = await self._prepare(request.request, context)
            message = await self._decide(prepared, context, span, exclude=[], errors={})
            return router_pb2.ExplainResponse(decision=message)

    async def ListBackends(self, request: router_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext):
        return router_pb2.ListBackendsResponse(backends=[_backend_message(b) for b in self.registry.backends.values()])

    async def _decide(self, prepared: Prepared, context, parent_span, exclude: list[str], errors: dict[str, str]):
        route_span = child_span(_tracer, parent_span, "route", attributes={"tandem.routing.policy": prepared.policy})
        try:
            message = await self._score(prepared, context, exclude, errors)
        except BaseException as exc:
            mark_failed(route_span, exc, context)
            raise
        else:
            if route_span.is_recording():
                route_span.set_attributes(_decision_attributes(message))
            return message
        finally:
            route_span.end()

    async def _score(self, prepared: Prepared, context, exclude: list[str], errors: dict[str, str]):
        candidates = [b for b in self.registry.healthy() if b.name not in exclude]
        estimates = await probe_all(candidates, prepared.prompt_token_ids, self.probe_deadline_s)
        views = [
            b.view(estimate) for b, estimate in zip(candidates, estimates)
            if estimate is None or estimate.serving_state == common_pb2.SERVING_STATE_SERVING
        ]
        try:
            decision = POLICIES[prepared.policy](
                views, RouteInput(prepared.prompt_tokens, prepared.max_new_tokens, self._sequence)
            )
        except NoEligibleWorker as exc:
            states = ", ".join(f"{b.name} ({errors.get(b.name) or b.describe()})" for b in self.registry.backends.values())
            code = grpc.StatusCode.UNAVAILABLE
            if errors and all(e.startswith("RESOURCE_EXHAUSTED") for e in errors.values()):
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, f"{exc}; workers: {states}")
        return self._decision_message(prepared, decision, views, exclude, errors)

    def _decision_message(self, prepared: Prepared, decision: Decision, views: list[WorkerView],
                          exclude: list[str], errors: dict[str, str]) -> router_pb2.RoutingDecision:
        by_name = {view.name: view for view in views}
        scores = []
        for score in decision.scores:
            view = by_name[score.worker]
            eligible = math.isfinite(score.score)
            scores.append(router_pb2.WorkerScore(
                worker=view.name, kind=WORKER_KINDS[view.kind], device=view.device, eligible=eligible,
                reason="" if eligible else f"excluded by policy {decision.policy}",
                score_s=score.score if eligible else 0.0, cached_tokens=view.cached_tokens,
                pending_prefill_tokens=view.pending_prefill_tokens, pending_decode_tokens=view.pending_decode_tokens,
                inflight_requests=view.inflight_requests, num_running=view.num_running, num_waiting=view.num_waiting,
                prefill_tokens_per_s=view.prefill_tok_s, decode_tokens_per_s=view.decode_tok_s,
                prefill_s=score.prefill_s, decode_s=score.decode_s, state_source=view.state_source,
            ))
        for backend in self.registry.backends.values():
            if backend.name not in by_name:
                reason = errors.get(backend.name) or ("failed" if backend.name in exclude else backend.describe())
                scores.append(router_pb2.WorkerScore(worker=backend.name, kind=WORKER_KINDS[backend.kind], eligible=False,
                                                     reason=reason))
        return router_pb2.RoutingDecision(
            policy=decision.policy, chosen_worker=decision.chosen, prompt_tokens=prepared.prompt_tokens,
            max_new_tokens=prepared.max_new_tokens, scores=scores, failed_workers=exclude,
        )

    async def _prepare(self, message: router_pb2.RouteRequest, context) -> Prepared:
        try:
            return await self._parse(message)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _parse(self, message: router_pb2.RouteRequest) -> Prepared:
        policy = message.policy or self.default_policy
        if policy not in POLICIES:
            raise InvalidRequestError("policy", f"must be one of {', '.join(POLICIES)}; got {policy!r}")
        if message.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {message.max_new_tokens}")
        sampling_params(message.sampling)  # validated here, so a bad value never costs a routing decision
        prompt = await self._tokenize(message)
        request_id = message.request_id or uuid.uuid4().hex
        worker_request = worker_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=worker_pb2.TokenIds(ids=prompt),
            max_new_tokens=message.max_new_tokens, sampling=message.sampling if message.HasField("sampling") else None,
            stop=message.stop, stop_token_ids=message.stop_token_ids, ignore_eos=message.ignore_eos,
        )
        return Prepared(request_id, prompt, policy, worker_request)

    async def _tokenize(self, message: router_pb2.RouteRequest) -> list[int]:
        kind = message.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "set prompt_token_ids, prompt_text or chat")
        if kind == "prompt_token_ids":
            if not message.prompt_token_ids.ids:
                raise InvalidRequestError("prompt_token_ids", "must not be empty")
            return list(message.prompt_token_ids.ids)
        if kind == "prompt_text":
            if not message.prompt_text:
                raise InvalidRequestError("prompt_text", "must not be empty")
            return await asyncio.to_thread(lambda: list(self.tokenizer(message.prompt_text)["input_ids"]))
        if not message.chat.messages:
            raise InvalidRequestError("chat.messages", "must not be empty")
        for index, chat_message in enumerate(message.chat.messages):
            if chat_message.role not in _CHAT_ROLES:
                raise InvalidRequestError(f"chat.messages[{index}].role", f"must be one of {', '.join(_CHAT_ROLES)}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("chat", "this model has no chat template; send prompt_text or prompt_token_ids")
        conversation = [{"role": m.role, "content": m.content} for m in message.chat.messages]
        try:
            return await asyncio.to_thread(
                lambda: list(self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=True, return_dict=False))
            )
        except Exception as exc:  # the model's template rejected the conversation (jinja raises freely)
            raise InvalidRequestError("chat", f"the chat template rejected the messages: {exc}") from None


def _uncached(message: router_pb2.RoutingDecision, prepared: Prepared) -> int:
    cached = next(s.cached_tokens for s in message.scores if s.worker == message.chosen_worker)
    return max(0, prepared.prompt_tokens - cached)


def _decision_attributes(message: router_pb2.RoutingDecision) -> dict:
    """The decision as span attributes: the choice, and every worker's score and its parts."""
    chosen = next((s for s in message.scores if s.worker == message.chosen_worker), None)
    attributes = {
        "tandem.routing.policy": message.policy,
        "tandem.routing.chosen_worker": message.chosen_worker,
        "tandem.routing.cached_tokens": chosen.cached_tokens if chosen else 0,
        "tandem.routing.failed_workers": list(message.failed_workers),
    }
    for s in message.scores:
        prefix = f"tandem.routing.worker.{s.worker}"
        attributes[f"{prefix}.eligible"] = s.eligible
        if s.eligible:
            attributes.update({
                f"{prefix}.score_s": s.score_s, f"{prefix}.cached_tokens": s.cached_tokens,
                f"{prefix}.pending_prefill_tokens": s.pending_prefill_tokens,
                f"{prefix}.pending_decode_tokens": s.pending_decode_tokens,
                f"{prefix}.inflight_requests": s.inflight_requests,
                f"{prefix}.prefill_tokens_per_s": s.prefill_tokens_per_s,
                f"{prefix}.decode_tokens_per_s": s.decode_tokens_per_s,
            })
        else:
            attributes[f"{prefix}.reason"] = s.reason
    return attributes


def _record_result(span, result: worker_pb2.GenerateResult) -> None:
    span.set_attributes({
        "gen_ai.usage.output_tokens": result.usage.output_tokens,
        "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(result.finish_reason)
                                           .removeprefix("FINISH_REASON_").lower()],
    })


def _log_decision(request_id: str, message: router_pb2.RoutingDecision) -> None:
    decision_log.info(json.dumps({
        "event": "route",
        "request_id": request_id,
        "policy": message.policy,
        "chosen": message.chosen_worker,
        "prompt_tokens": message.prompt_tokens,
        "max_new_tokens": message.max_new_tokens,
        "failed_workers": list(message.failed_workers),
        "scores": [
            {
                "worker": s.worker, "eligible": s.eligible, "reason": s.reason, "score_s": s.score_s,
                "cached_tokens": s.cached_tokens, "pending_prefill_tokens": s.pending_prefill_tokens,
                "pending_decode_tokens": s.pending_decode_tokens, "inflight_requests": s.inflight_requests,
                "prefill_tokens_per_s": s.prefill_tokens_per_s, "decode_tokens_per_s": s.decode_tokens_per_s,
                "prefill_s": s.prefill_s, "decode_s": s.decode_s, "state_source": s.state_source,
            }
            for s in message.scores
        ],
    }))


def _backend_message(backend: Backend) -> router_pb2.Backend:
    info = backend.info
    return router_pb2.Backend(
        name=backend.name, address=backend.address.address, kind=WORKER_KINDS[backend.kind],
        device=backend.state.device if backend.state is not None else (info.device if info else ""),
        healthy=backend.healthy, status=backend.describe(), state=backend.state,
        model_fingerprint=info.model_fingerprint if info else "", routed_requests=backend.routed_requests,
        inflight_requests=len(backend.credits), failed_requests=backend.failed_requests,
    )
