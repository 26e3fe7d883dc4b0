"""Fuzzing both services' request messages (hypothesis, hand-written strategies, random bytes).

Every request ends with a result or INVALID_ARGUMENT (RESOURCE_EXHAUSTED for oversized messages); none
crashes or hangs a service or gets UNKNOWN/INTERNAL, and the services serve normally afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.integration.workers import SERVING, RouterProcess, running_worker

pytestmark = pytest.mark.slow

INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1]))
FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                  st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38]))
TEXT = st.one_of(st.text(max_size=40), st.text(max_size=5000), st.just("x" * 200_000))
SMALL_NEW = st.one_of(st.integers(1, 6), INT32)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@st.composite
def sampling(draw):
    fields = {}
    for name, strategy in (("temperature", FLOAT), ("top_p", FLOAT), ("top_k", INT32),
                           ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    return common_pb2.SamplingParams(**fields)


@st.composite
def prompt(draw, vocab_size: int):
    kind = draw(st.sampled_from(["ids", "ids_in_vocab", "text", "none"]))
    if kind == "ids":
        return {"prompt_token_ids": worker_pb2.TokenIds(ids=draw(st.lists(INT32, max_size=50)))}
    if kind == "ids_in_vocab":
        return {"prompt_token_ids": worker_pb2.TokenIds(ids=draw(st.lists(st.integers(0, vocab_size - 1), max_size=60)))}
    if kind == "text":
        return {"prompt_text": draw(TEXT)}
    return {}


def _common(draw, vocab_size: int) -> dict:
    return dict(request_id=draw(st.one_of(st.text(max_size=20), st.just("r" * 100_000))),
                max_new_tokens=draw(SMALL_NEW), sampling=draw(sampling()),
                stop=draw(st.lists(st.text(max_size=10), max_size=4)), stop_token_ids=draw(st.lists(INT32, max_size=4)),
                ignore_eos=draw(st.booleans()), **draw(prompt(vocab_size)))


@st.composite
def route_requests(draw, vocab_size: int):
    fields = _common(draw, vocab_size)
    if "prompt_token_ids" not in fields and "prompt_text" not in fields and draw(st.booleans()):
        roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8))
        fields["chat"] = router_pb2.ChatMessages(messages=[
            router_pb2.ChatMessage(role=draw(roles), content=draw(st.text(max_size=50)))
            for _ in range(draw(st.integers(0, 3)))])
    return router_pb2.RouteRequest(policy=draw(st.one_of(st.just(""), st.sampled_from(["cost", "finish_time"]),
                                                         st.text(max_size=12))), **fields)


@st.composite
def generate_requests(draw, vocab_size: int):
    return worker_pb2.GenerateRequest(**_common(draw, vocab_size))


def invalid_utf8_stop(message: bytes, field_number: int) -> bytes:
    """``message`` plus a string field ``field_number`` holding bytes that are not UTF-8."""
    payload = b"\xff\xfe\xc3(stop"
    return message + bytes([field_number << 3 | 2, len(payload)]) + payload


@pytest.fixture(scope="module")
def services(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    with running_worker(tiny_llama, logs / "worker.log") as worker:
        router = RouterProcess(tiny_llama, logs / "router.log", [f"w=cpu@{worker.address}"])
        try:
            router.wait_for_health(SERVING)
            router.wait_for_backends({"w"})
            vocab = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).vocab_size
            yield router, worker, vocab
            assert router.alive and worker.alive
            assert router.health_status() == SERVING and worker.health_status() == SERVING
            assert worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=[5, 6]), timeout=5).num_running == 0
        finally:
            router.close()


def _drain(call) -> grpc.StatusCode:
    try:
        responses = list(call)
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details())
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert exc.details(), "INVALID_ARGUMENT without a message"
        return exc.code()
    assert responses[-1].HasField("result"), "a stream ended without its result"
    return grpc.StatusCode.OK


def test_router_generate_survives_fuzzed_requests(services):
    router, _, vocab = services

    @FUZZ
    @given(route_requests(vocab))
    def check(request):
        _drain(router.stub.Generate(request, timeout=30))

    check()


def test_router_explain_survives_fuzzed_requests(services):
    router, _, vocab = services

    @FUZZ
    @given(route_requests(vocab))
    def check(request):
        try:
            router.stub.Explain(router_pb2.ExplainRequest(request=request), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (exc.code(), exc.details())

    check()


def test_worker_generate_and_estimate_survive_fuzzed_requests(services):
    _, worker, vocab = services

    @FUZZ
    @given(generate_requests(vocab), st.lists(INT32, max_size=40))
    def check(request, estimate_ids):
        _drain(worker.stub.Generate(request, timeout=30))
        try:
            worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=estimate_ids), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())

    check()


def test_worker_estimate_stream_survives_fuzzed_and_malformed_messages(services):
    _, worker, _ = services

    @FUZZ
    @given(st.lists(st.lists(INT32, max_size=40), max_size=8))
    def check(prompts):
        requests = [worker_pb2.EstimateRequest(prompt_token_ids=prompt) for prompt in prompts]
        answers = list(worker.stub.EstimateStream(iter(requests), timeout=10))
        assert len(answers) == len(prompts)
        assert all(answer.cached_tokens <= max(0, len(prompt) - 1) for answer, prompt in zip(answers, prompts))

    check()
    raw_call = worker.channel.stream_stream("/tandem.v1.Worker/EstimateStream")
    call = raw_call(iter([worker_pb2.EstimateRequest(prompt_token_ids=[5]).SerializeToString(), b"\xff\xff\xff"]),
                    timeout=10)
    assert common_pb2.BackendState.FromString(next(call)).serving_state == common_pb2.SERVING_STATE_SERVING
    with pytest.raises(grpc.RpcError) as error:
        next(call)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in error.value.details()


def test_worker_watch_state_rejects_bad_intervals(services):
    _, worker, _ = services

    @FUZZ
    @given(FLOAT)
    def check(interval):
        call = worker.stub.WatchState(worker_pb2.WatchStateRequest(interval_s=interval), timeout=0.5)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            assert exc.code() in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED}, exc.details()

    check()


@pytest.mark.parametrize("target", ["router", "worker"])
def test_random_bytes_and_invalid_utf8_get_invalid_argument(services, target):
    router, worker, _ = services
    process, method, stop_field, valid = {
        "router": (router, "/tandem.v1.Router/Generate", 7, router_pb2.RouteRequest(prompt_text="hi", max_new_tokens=2)),
        "worker": (worker, "/tandem.v1.Worker/Generate", 6,
                   worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=[5, 6]), max_new_tokens=2)),
    }[target]
    raw_call = process.channel.unary_stream(method)

    def outcome(payload: bytes) -> grpc.StatusCode:
        try:
            list(raw_call(payload, timeout=30))
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (payload[:40], exc.code(), exc.details())
            return exc.code()

    assert outcome(invalid_utf8_stop(valid.SerializeToString(), stop_field)) == grpc.StatusCode.INVALID_ARGUMENT

    @FUZZ
    @given(st.binary(max_size=300))
    def check(payload):
        outcome(payload)

    check()


def test_oversized_messages_get_resource_exhausted(services):
    router, worker, _ = services
    huge = "y" * (5 << 20)  # over the default 4 MiB limit
    with pytest.raises(grpc.RpcError) as error:
        list(router.stub.Generate(router_pb2.RouteRequest(prompt_text=huge, max_new_tokens=1), timeout=30))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as error:
        list(worker.stub.Generate(worker_pb2.GenerateRequest(prompt_text=huge, max_new_tokens=1), timeout=30))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
