"""The tandem.v1.Router servicer: the gRPC front end. It parses a RouteRequest into a ``Submission``, has it
prepared (``router_svc.frontends.preparation``), and streams the router's events back as RouteResponses."""

from __future__ import annotations

import time
import uuid

import grpc

from router_svc import metrics
from router_svc.errors import RoutingError
from router_svc.frontends.preparation import Preparation, Submission
from router_svc.request_path import RoutedRequest, Router
from tandem.decision import RoutingDecision
from tandem.errors import InvalidRequestError
from tandem.protocol import decision_message, prompt_token_ids
from tandem.telemetry import server_span, tracer
from tandem.v1 import router_pb2, router_pb2_grpc

_tracer = tracer("tandem.router")
_record_generate_status = metrics.rpc_status_recorder("Generate")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, tokenizer, preparation: Preparation):
        self.router = router
        self.tokenizer = tokenizer
        self.preparation = preparation

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
                        logprobs=response.logprobs, prompt_logprobs=response.prompt_logprobs, index=response.index,
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
        prompt = await prompt_token_ids(message, self.tokenizer)
        given = message.WhichOneof("prompt")
        return await self.preparation.prepare(Submission(
            request_id=message.request_id or uuid.uuid4().hex, prompt_token_ids=prompt,
            max_new_tokens=message.max_new_tokens, frontend="grpc", prompt_field="chat.messages" if given == "chat" else given,
            policy=message.policy, length_key=message.length_key, sampling=message.sampling, stop=tuple(message.stop),
            stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos,
            include_stop_string=message.include_stop_string, keep_special_tokens=message.keep_special_tokens,
            n=message.n or 1, deadline=None if time_remaining is None else time.monotonic() + time_remaining,
        ))


async def _abort(context: grpc.aio.ServicerContext, exc: RoutingError | InvalidRequestError) -> None:
    """End the RPC with the status the error maps to: the one mapping of errors to gRPC codes at this edge."""
    if isinstance(exc, InvalidRequestError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    await context.abort(grpc.StatusCode[exc.status.name], str(exc))
