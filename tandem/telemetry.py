"""Tracing from the standard OTEL_* environment, and W3C trace context carried in gRPC metadata.

Without ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) no SDK is
installed: spans are non-recording and cost next to nothing, while incoming trace context is still
passed on to the next hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def setup_tracing(default_service_name: str):
    """Install an OTLP-exporting tracer provider when an endpoint is configured; return it (or None).

    ``OTEL_SERVICE_NAME`` overrides ``default_service_name``; call ``shutdown()`` on the provider at
    exit to flush the spans still buffered.
    """
    if not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def outgoing_metadata(span: trace.Span | None = None) -> list[tuple[str, str]]:
    """Trace context as gRPC metadata (``traceparent``, ``tracestate``): ``span``'s, or the current one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return list(carrier.items())


def incoming_context(context: grpc.aio.ServicerContext):
    """The trace context a caller sent in its gRPC metadata (empty when it sent none)."""
    return propagate.extract({key: value for key, value in (context.invocation_metadata() or ())})


def wall_time_ns(monotonic_s: float) -> int:
    """Convert a ``time.monotonic()`` reading to wall-clock nanoseconds, for spans timed after the fact."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


@contextlib.contextmanager
def server_span(tracer_: trace.Tracer, method: str, context: grpc.aio.ServicerContext,
                attributes: dict | None = None,
                on_status: Callable[[grpc.StatusCode], None] | None = None) -> Iterator[trace.Span]:
    """A SERVER span for one RPC, child of the caller's context, ended with the RPC's real outcome.

    The span is passed explicitly, never made current: a streaming handler is an async generator,
    and context variables do not survive its suspension reliably. Cancellation (the client went
    away or its deadline passed) is recorded as an error named "cancelled", which the grpc.aio
    instrumentation would record as OK. ``on_status`` receives the RPC's final status code.
    """
    service, _, name = method.rpartition("/")
    span = tracer_.start_span(
        method, context=incoming_context(context), kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, **(attributes or {})},
    )
    code = grpc.StatusCode.OK
    try:
        yield span
    except BaseException as exc:
        code = mark_failed(span, exc, context)
        raise
    finally:
        span.end()
        if on_status is not None:
            on_status(code)


def child_span(tracer_: trace.Tracer, parent: trace.Span, name: str, kind: SpanKind = SpanKind.INTERNAL,
               attributes: dict | None = None, start_time: int | None = None) -> trace.Span:
    """A span under ``parent`` (not made current); the caller ends it."""
    return tracer_.start_span(name, context=trace.set_span_in_context(parent), kind=kind, attributes=attributes,
                              start_time=start_time)


def mark_failed(span: trace.Span, exc: BaseException, context=None) -> grpc.StatusCode:
    """Record how an RPC ended on ``span`` (cancelled, or an error with its gRPC status code); return the code."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        code = grpc.StatusCode.CANCELLED
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
    else:
        code = _status_code(exc, context)
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {_details(exc, context)}"))
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    return code


def mark_failed_status(span: trace.Span, status_name: str, message: str) -> None:
    """Record on ``span`` that the request ended with the status named ``status_name``, saying ``message``."""
    span.set_status(Status(StatusCode.ERROR, f"{status_name}: {message}"))


def _status_code(exc: BaseException, context) -> grpc.StatusCode:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return exc.code()
    code = context.code() if context is not None else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _details(exc: BaseException, context) -> str:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "details", None)):
        return exc.details() or ""
    details = context.details() if context is not None else None
    return details or str(exc)
