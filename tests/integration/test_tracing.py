"""One trace across client → router → worker → engine, collected by an in-process OTLP collector."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tandem.launch import SERVING, free_port
from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.integration.workers import RouterProcess, WorkerProcess


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Receives OTLP trace exports and keeps every span with its service name."""

    def __init__(self):
        self.spans: list[tuple[str, trace_pb2.Span]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> dict[tuple[str, str], trace_pb2.Span]:
        return {(service, span.name, span.kind): span for service, span in self.spans if span.trace_id == trace_id}


@pytest.fixture(scope="module")
def traced_stack(tiny_llama, tmp_path_factory):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    logs = tmp_path_factory.mktemp("traced")
    worker = WorkerProcess(tiny_llama, logs / "worker.log", env=env)
    router = None
    try:
        worker.wait_for_health()
        http_port = free_port()
        router = RouterProcess(tiny_llama, logs / "router.log", [f"cpu=cpu@{worker.address}"],
                               "--http-port", str(http_port), env=env)
        router.http_url = f"http://127.0.0.1:{http_port}"
        router.wait_for_health(SERVING)
        router.wait_for_backends({"cpu"})
        yield router, collector
    finally:
        if router is not None:
            router.close()
        worker.close()
        server.stop(0)


def client_span(name: str):
    """A client span from the test's own SDK tracer, and gRPC metadata carrying its context."""
    span = TracerProvider().get_tracer("test-client").start_span(name, kind=SpanKind.CLIENT)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return span, list(carrier.items())


def wait_for(collector: Collector, trace_id: bytes, keys: set, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = collector.trace(trace_id)
        if keys <= set(spans):
            return spans
        time.sleep(0.05)
    raise AssertionError(f"missing spans {keys - set(collector.trace(trace_id))}; have {set(collector.trace(trace_id))}")


SERVER, CLIENT, INTERNAL = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT, trace_pb2.Span.SPAN_KIND_INTERNAL


def attributes(span: trace_pb2.Span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}


def test_one_trace_joins_client_router_worker_and_engine(traced_stack):
    router, collector = traced_stack
    span, metadata = client_span("client generate")
    request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(10, 50))), max_new_tokens=6,
                                      sampling=common_pb2.SamplingParams(temperature=0), ignore_eos=True)
    responses = list(router.stub.Generate(request, metadata=metadata, timeout=60))
    span.end()
    assert responses[-1].result.usage.output_tokens == 6
    trace_id = span.get_span_context().trace_id.to_bytes(16, "big")
    spans = wait_for(collector, trace_id, {
        ("router", "tandem.v1.Router/Generate", SERVER), ("router", "route", INTERNAL),
        ("router", "tandem.v1.Worker/Generate", CLIENT), ("cpu-worker", "tandem.v1.Worker/Generate", SERVER),
        ("cpu-worker", "engine.queue", INTERNAL), ("cpu-worker", "engine.prefill", INTERNAL),
        ("cpu-worker", "engine.decode", INTERNAL),
    })
    router_server = spans[("router", "tandem.v1.Router/Generate", SERVER)]
    route = spans[("router", "route", INTERNAL)]
    router_client = spans[("router", "tandem.v1.Worker/Generate", CLIENT)]
    worker_server = spans[("cpu-worker", "tandem.v1.Worker/Generate", SERVER)]
    assert router_server.parent_span_id == span.get_span_context().span_id.to_bytes(8, "big")
    assert route.parent_span_id == router_client.parent_span_id == router_server.span_id
    assert worker_server.parent_span_id == router_client.span_id
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert spans[("cpu-worker", phase, INTERNAL)].parent_span_id == worker_server.span_id

    routing = attributes(route)
    assert routing["tandem.routing.policy"] == "finish_time" and routing["tandem.routing.chosen_worker"] == "cpu"
    assert routing["tandem.routing.worker.cpu.score_s"] > 0 and "tandem.routing.worker.cpu.pending_decode_tokens" in routing
    worker_attributes = attributes(worker_server)
    assert worker_attributes["gen_ai.request.max_tokens"] == 6
    assert worker_attributes["gen_ai.usage.input_tokens"] == 40 and worker_attributes["gen_ai.usage.output_tokens"] == 6
    assert worker_attributes["gen_ai.response.finish_reasons"] == ["length"]
    prefill = attributes(spans[("cpu-worker", "engine.prefill", INTERNAL)])
    assert prefill["tandem.cached_tokens"] + prefill["tandem.computed_tokens"] == 40
    decode = spans[("cpu-worker", "engine.decode", INTERNAL)]
    assert [event.name for event in decode.events] == ["first_token"]
    assert router_server.status.code == worker_server.status.code == trace_pb2.Status.STATUS_CODE_UNSET


def test_a_cancelled_request_produces_spans_marked_cancelled(traced_stack):
    router, collector = traced_stack
    span, metadata = client_span("client cancel")
    request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(60, 80))), max_new_tokens=900,
                                      sampling=common_pb2.SamplingParams(temperature=0), ignore_eos=True)
    call = router.stub.Generate(request, metadata=metadata, timeout=60)
    next(call)
    next(call)
    call.cancel()
    span.end()
    trace_id = span.get_span_context().trace_id.to_bytes(16, "big")
    spans = wait_for(collector, trace_id, {("router", "tandem.v1.Router/Generate", SERVER),
                                           ("cpu-worker", "tandem.v1.Worker/Generate", SERVER)})
    for key in (("router", "tandem.v1.Router/Generate", SERVER), ("cpu-worker", "tandem.v1.Worker/Generate", SERVER)):
        assert spans[key].status.code == trace_pb2.Status.STATUS_CODE_ERROR
        assert spans[key].status.message == "cancelled"
        assert attributes(spans[key])["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


def test_an_http_request_joins_the_same_trace(traced_stack):
    import httpx

    router, collector = traced_stack
    span, metadata = client_span("client http")
    model = httpx.get(f"{router.http_url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": list(range(90, 110)), "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{router.http_url}/v1/completions", json=body, headers=dict(metadata), timeout=60) as response:
        assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
    span.end()
    trace_id = span.get_span_context().trace_id.to_bytes(16, "big")
    spans = wait_for(collector, trace_id, {
        ("router", "POST /v1/completions", SERVER), ("router", "route", INTERNAL),
        ("router", "tandem.v1.Worker/Generate", CLIENT), ("cpu-worker", "tandem.v1.Worker/Generate", SERVER),
    })
    router_server = spans[("router", "POST /v1/completions", SERVER)]
    router_client = spans[("router", "tandem.v1.Worker/Generate", CLIENT)]
    assert [s.name for service, s in collector.spans if s.trace_id == trace_id and service == "router"
            and s.kind == SERVER] == ["POST /v1/completions"]  # one server span per request, not one per framework
    assert router_server.parent_span_id == span.get_span_context().span_id.to_bytes(8, "big")
    assert spans[("router", "route", INTERNAL)].parent_span_id == router_client.parent_span_id == router_server.span_id
    assert spans[("cpu-worker", "tandem.v1.Worker/Generate", SERVER)].parent_span_id == router_client.span_id
    assert attributes(router_server)["gen_ai.usage.output_tokens"] == 4
    assert router_server.status.code == trace_pb2.Status.STATUS_CODE_UNSET
