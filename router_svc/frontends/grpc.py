"""The tandem.v1.Router servicer: the gRPC front end of the router's request path (``router_svc.request_path``)."""

from __future__ import annotations

import time
import uuid

import grpc

from router_svc import metrics
from router_svc.errors import RoutingError
from router_svc.output_lengths import check_length_key
from router_svc.policies import POLICIES
from router_svc.request_path import RoutedRequest, Router
from tandem.decision import RoutingDecision
from tandem.errors import InvalidRequestError
from tandem.protocol import decision_message, prompt_token_ids, sampling_params
from tandem.telemetry import server_span, tracer
from tandem.v1 import router_pb2, router_pb2_grpc, worker_pb2

_tracer = tracer("tandem.router")
_record_generate_status = metrics.rpc_status_recorder("Generate")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, tokenizer, default_policy: str):
        self.router = router
        self.tokenizer = tokenizer
        self.default_policy = default_policy

    async def Generate(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):
        with server_span(_tracer, "tandem.v1.Router/Generate", context,
                         {"gen_ai.request.max_tokens": request.max_new_tokens},
                         on_status=_record_generate_status) as span:
            routed = await self._prepare(request, context)
            span.set_attributes({"tandem.request_id": routed.request_id,
                                 "gen_ai.usage.input_tokens": routed.prompt_tokens})
            try:
                async for event in self.router.generate(routed, span):
                    if isinstance(event, RoutingDecision):
                        yield router_pb2.RouteResponse(request_id=routed.request_id, decision=decision_message(event))
                        continue
                    response = event.response
                    yield router_pb2.RouteResponse(
                        request_id=routed.request_id, token_ids=response.token_ids, text=response.text,
                        result=response.result if response.HasField("result") else None, worker=event.worker,
                    )
            except RoutingError as exc:
                await _abort(context, exc)

    async def Explain(self, request: router_pb2.ExplainRequest, context: grpc.aio.ServicerContext):
        with server_span(_tracer, "tandem.v1.Router/Explain", context,
                         on_status=metrics.rpc_status_recorder("Explain")) as span:
            routed = await self._prepare(request.request, context)
            try:
                decision = await self.router.decide(routed, span)
            except RoutingError as exc:
                await _abort(context, exc)
            return router_pb2.ExplainResponse(decision=decision_message(decision))

    async def ListBackends(self, request: router_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext):
        return router_pb2.ListBackendsResponse(
            backends=[b.message() for b in self.router.registry.listed()],
            output_lengths=[router_pb2.LearnedOutputLength(key=learned.key, fraction=learned.fraction,
                                                           samples=learned.samples)
                            for learned in self.router.output_lengths.learned()])

    async def _prepare(self, message: router_pb2.RouteRequest, context) -> RoutedRequest:
        try:
            return await self._parse(message, context.time_remaining())
        except InvalidRequestError as exc:
            await _abort(context, exc)

    async def _parse(self, message: router_pb2.RouteRequest, time_remaining: float | None) -> RoutedRequest:
        policy = message.policy or self.default_policy
        if policy not in POLICIES:
            raise InvalidRequestError("policy", f"must be one of {', '.join(POLICIES)}; got {policy!r}")
        if message.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {message.max_new_tokens}")
        check_length_key("length_key", message.length_key)
        sampling_params(message.sampling)  # validated here, so a bad value never costs a routing decision
        prompt = await prompt_token_ids(message, self.tokenizer)
        request_id = message.request_id or uuid.uuid4().hex
        worker_request = worker_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=worker_pb2.TokenIds(ids=prompt),
            max_new_tokens=message.max_new_tokens, sampling=message.sampling if message.HasField("sampling") else None,
            stop=message.stop, stop_token_ids=message.stop_token_ids, ignore_eos=message.ignore_eos,
        )
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        return RoutedRequest(request_id, prompt, message.max_new_tokens, policy, worker_request, deadline,
                             length_key=message.length_key)


async def _abort(context: grpc.aio.ServicerContext, exc: RoutingError | InvalidRequestError) -> None:
    """End the RPC with the status the error maps to: the one mapping of errors to gRPC codes at this edge."""
    if isinstance(exc, InvalidRequestError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    await context.abort(grpc.StatusCode[exc.status.name], str(exc))
