"""What every Tandem gRPC service shares: the server with health and reflection, and the metrics port."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.security import ServerTLS

logger = logging.getLogger(__name__)

# The quickest keepalive a server takes: a client may ping it once a second, even on a connection with no
# call or data (more often earns strikes, then GOAWAY). The router pings its workers (``keepalive_options``).
MIN_KEEPALIVE_S = 1.0
_PING_POLICY = [("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000)),
                ("grpc.keepalive_permit_without_calls", 1)]


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """A channel's options that ping the server after ``interval_s`` seconds without a frame from it, and fail
    every call on the connection when a ping goes unanswered for as long again: a frozen host or a cut
    network ends its calls instead of leaving them open forever (a closed connection ends them at once)."""
    ms = int(interval_s * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class GrpcService:
    """A grpc.aio server listening on ``host:port`` for ``service_name``, with health and reflection.

    Health starts NOT_SERVING; ``set_health`` sets it for the whole server and for ``service_name``.
    With ``tls`` the port serves TLS (mTLS when it names a client CA); ``interceptors`` see every call.
    """

    def __init__(self, service_name: str, host: str, port: int, options: list[tuple[str, int]] | None = None,
                 tls: ServerTLS | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.service_name = service_name
        self.address = f"{host}:{port}"
        self.server = grpc.aio.server(options=[*_PING_POLICY, *(options or [])],
                                      interceptors=[*interceptors, MalformedRequestGuard()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((service_name, HEALTH_SERVICE, reflection.SERVICE_NAME), self.server)
        if tls is not None:
            bound = self.server.add_secure_port(self.address, tls.credentials())
        else:
            bound = self.server.add_insecure_port(self.address)
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")

    async def start(self) -> None:
        """Serve, health NOT_SERVING until ``set_health`` says otherwise (grpc's health servicer answers SERVING
        for the whole server until told)."""
        await self.set_health(False)
        await self.server.start()

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", self.service_name):
            await self.health.set(service, status)


class _Malformed:
    def __init__(self, reason: str):
        self.reason = reason


async def _well_formed(request, context: grpc.aio.ServicerContext):
    """``request``, or INVALID_ARGUMENT naming why it could not be decoded."""
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.reason}")
    return request


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, naming the decoding error, to a request that is not a valid message of
    its method's type (corrupt wire format, bad UTF-8 in a string field), instead of gRPC's UNKNOWN.

    Covers Tandem's own methods (``/tandem.``): unary, server-streaming and bidirectional.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith("/tandem.")
                or handler.request_deserializer is None
                or (handler.request_streaming and not handler.response_streaming)):
            return handler
        decode = handler.request_deserializer

        def lenient_decode(data: bytes):
            try:
                return decode(data)
            except Exception as exc:  # any decoding failure is the client's malformed message
                return _Malformed(f"{type(exc).__name__}: {exc}")

        kwargs = dict(request_deserializer=lenient_decode, response_serializer=handler.response_serializer)
        if handler.request_streaming:
            async def bidi(requests, context):
                async def checked():
                    async for request in requests:
                        yield await _well_formed(request, context)

                async for response in handler.stream_stream(checked(), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(bidi, **kwargs)

        if handler.response_streaming:
            async def stream(request, context):
                async for response in handler.unary_stream(await _well_formed(request, context), context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(stream, **kwargs)

        async def unary(request, context):
            return await handler.unary_unary(await _well_formed(request, context), context)

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def serve_metrics(host: str, port: int) -> None:
    """Serve Prometheus metrics on ``host:port`` (a background thread); 0 disables them."""
    if not port:
        return
    from prometheus_client import start_http_server

    start_http_server(port, addr=host)
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, port)
