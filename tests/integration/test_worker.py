"""A real cpu_worker process on 127.0.0.1 serving the tiny model, called over gRPC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.prefix_hash import extend_block_hashes
from tandem.v1 import common_pb2, worker_pb2
from tests.engine.helpers import hf_greedy
from tests.integration.workers import WorkerProcess, running_worker, wait_until

GREEDY = common_pb2.SamplingParams(temperature=0)


def generate(stub, **fields) -> list[worker_pb2.GenerateResponse]:
    return list(stub.Generate(worker_pb2.GenerateRequest(**fields), timeout=60))


def ids(values) -> worker_pb2.TokenIds:
    return worker_pb2.TokenIds(ids=values)


def estimate(worker: WorkerProcess, prompt=()) -> common_pb2.BackendState:
    return worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=list(prompt)), timeout=5)


def test_streamed_generation_matches_reference(worker, tiny_llama):
    prompt = list(range(10, 40))
    responses = generate(worker.stub, request_id="stream-1", prompt_token_ids=ids(prompt), max_new_tokens=12,
                         sampling=GREEDY, ignore_eos=True)
    assert len(responses) == 12
    assert all(r.request_id == "stream-1" for r in responses)
    assert [t for r in responses for t in r.token_ids] == hf_greedy(tiny_llama, prompt, 12)
    result = responses[-1].result
    assert result.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (result.usage.prompt_tokens, result.usage.output_tokens) == (30, 12)
    assert 0 <= result.timings.queue_time_s <= result.timings.ttft_s <= result.timings.total_time_s
    assert not any(r.HasField("result") for r in responses[:-1])


def test_text_prompt_is_tokenized_by_the_worker(worker):
    responses = generate(worker.stub, prompt_text="The quick brown fox", max_new_tokens=4, sampling=GREEDY, ignore_eos=True)
    assert responses[-1].result.usage.prompt_tokens > 0
    assert sum(len(r.token_ids) for r in responses) == 4


def test_estimate_reports_cache_hit_after_shared_prefix(worker):
    prefix = list(range(100, 148))  # three full blocks of 16
    assert estimate(worker, prefix + [7, 8]).cached_tokens == 0
    generate(worker.stub, prompt_token_ids=ids(prefix + [5]), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    state = estimate(worker, prefix + [7, 8])
    assert state.cached_tokens == state.cached_tokens_evictable == 48  # the request is done: nothing holds them
    assert state.kind == common_pb2.WORKER_KIND_CPU and state.device == "cpu"
    assert state.serving_state == common_pb2.SERVING_STATE_SERVING
    assert state.rates.prefill_tokens_per_s > 0 and state.rates.decode_tokens_per_s > 0
    responses = generate(worker.stub, prompt_token_ids=ids(prefix + [7, 8]), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    assert responses[-1].result.usage.cached_tokens == 48


def test_estimate_stream_answers_every_probe_in_order(worker):
    prefix = list(range(300, 348))  # three full blocks of 16
    generate(worker.stub, prompt_token_ids=ids(prefix + [5]), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    prompts = [prefix + [7], [1, 2, 3], prefix[:32] + [9], [], prefix + [8, 9]]
    answers = list(worker.stub.EstimateStream(
        iter([worker_pb2.EstimateRequest(prompt_token_ids=prompt) for prompt in prompts]), timeout=10))
    assert [answer.cached_tokens for answer in answers] == [48, 0, 32, 0, 48]
    assert all(answer.serving_state == common_pb2.SERVING_STATE_SERVING for answer in answers)


def test_watch_state_sends_the_prefix_cache_index_whole_then_what_changes(worker):
    prefix = list(range(340, 388)) + [5]  # three full blocks of 16
    generate(worker.stub, prompt_token_ids=ids(prefix), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    call = worker.stub.WatchState(worker_pb2.WatchStateRequest(interval_s=0.05, prefix_cache_changes=True), timeout=30)
    listing = next(call).prefix_cache_changes
    assert listing.reset and not listing.continued
    assert set(block_hashes(prefix, 3)) <= set(listing.free) and not set(block_hashes(prefix, 3)) & set(listing.held)

    other = list(range(150, 182)) + [1]  # two full blocks
    generate(worker.stub, prompt_token_ids=ids(other), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    standing = {}
    for state in call:
        changes = state.prefix_cache_changes
        assert not changes.reset
        standing.update({h: "held" for h in changes.held} | {h: "free" for h in changes.free})
        if [standing.get(h) for h in block_hashes(other, 2)] == ["free", "free"]:
            break
    call.cancel()
    assert worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=other), timeout=5).cached_tokens == 32
    plain = next(iter(worker.stub.WatchState(worker_pb2.WatchStateRequest(interval_s=0.05), timeout=5)))
    assert not plain.HasField("prefix_cache_changes")


def block_hashes(tokens: list[int], count: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, count)
    return hashes


def test_cancel_mid_stream_frees_everything(worker):
    call = worker.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=ids(list(range(50))), max_new_tokens=900,
                                                           sampling=GREEDY, ignore_eos=True), timeout=60)
    next(call)
    assert estimate(worker).num_running == 1
    call.cancel()
    state = wait_until(lambda: (s := estimate(worker)).num_running == 0 and s.kv_blocks_used == 0 and s)
    assert state.num_waiting == 0 and state.pending_decode_tokens == 0


def test_deadline_aborts_the_request_in_the_worker(worker):
    with pytest.raises(grpc.RpcError) as info:
        for _ in worker.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=ids(list(range(50))), max_new_tokens=900,
                                                                 sampling=GREEDY, ignore_eos=True), timeout=0.2):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: (s := estimate(worker)).num_running == 0 and s.kv_blocks_used == 0)


def test_watch_state_streams_snapshots_as_the_state_changes(worker):
    stream = worker.stub.WatchState(worker_pb2.WatchStateRequest(interval_s=0.5), timeout=30)
    first = next(stream)
    generate(worker.stub, prompt_token_ids=ids([1, 2, 3]), max_new_tokens=3, sampling=GREEDY, ignore_eos=True)
    started = time.monotonic()
    later = next(stream)
    assert later.seq > first.seq
    assert time.monotonic() - started < 0.5  # pushed on change, not only at the heartbeat
    stream.cancel()


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        (dict(prompt_token_ids=ids([]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (dict(prompt_text="", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_text"),
        (dict(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompt_token_ids=ids([1, 99999]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (dict(prompt_token_ids=ids([1, -5]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(temperature=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(temperature=float("nan"))),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(top_p=1.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(top_k=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, stop_token_ids=[123456]), grpc.StatusCode.INVALID_ARGUMENT,
         "stop_token_ids"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT,
         "request_id"),
        (dict(prompt_text="x" * (5 << 20), max_new_tokens=4), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    ],
)
def test_invalid_input_gets_its_status_and_names_the_field(worker, fields, code, field):
    with pytest.raises(grpc.RpcError) as info:
        generate(worker.stub, **fields)
    assert info.value.code() == code
    if field is not None:
        assert info.value.details().startswith(field + ":"), info.value.details()
    assert worker.health_status() == 1  # still serving
    assert estimate(worker).num_running == 0


def test_get_info_describes_model_and_limits(worker):
    info = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert len(info.model_fingerprint) == 64
    assert (info.device, info.dtype, info.kind) == ("cpu", "float32", common_pb2.WORKER_KIND_CPU)
    assert info.block_size == 16 and info.max_active_requests == 8 and info.context_length == 1024
    assert info.vocab_size > 0 and info.rates.calibration_steps == 4
    assert info.rates.small_step_rows == 0  # no decode copy of the weights: every step follows one model


def test_reflection_lists_the_services(worker):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = set(ProtoReflectionDescriptorDatabase(worker.channel).get_services())
    assert {"tandem.v1.Worker", "grpc.health.v1.Health"} <= services


def test_generate_without_generated_stubs(worker):
    """The API is usable from its .proto alone: descriptors come from reflection, messages are built dynamically."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    channel = grpc.insecure_channel(worker.address)
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("tandem.v1.Worker").FindMethodByName("Generate")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    request = request_class()
    request.prompt_token_ids.ids.extend([5, 6, 7])
    request.max_new_tokens = 3
    request.ignore_eos = True
    request.sampling.temperature = 0
    call = channel.unary_stream("/tandem.v1.Worker/Generate", request_serializer=request_class.SerializeToString,
                                response_deserializer=response_class.FromString)
    responses = list(call(request, timeout=30))
    assert sum(len(r.token_ids) for r in responses) == 3
    assert responses[-1].result.usage.output_tokens == 3
    channel.close()


@pytest.fixture(scope="module")
def single_slot_worker(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("single") / "worker.log"
    with running_worker(tiny_llama, log, "--max-active", "1", "--max-waiting", "1", "--max-batched-tokens", "16") as process:
        yield process


def test_pending_budgets_move_as_requests_queue_run_and_finish(single_slot_worker):
    worker = single_slot_worker
    request = dict(prompt_token_ids=ids(list(range(40))), max_new_tokens=900, sampling=GREEDY, ignore_eos=True)
    first = worker.stub.Generate(worker_pb2.GenerateRequest(**request), timeout=60)
    next(first)
    second = worker.stub.Generate(worker_pb2.GenerateRequest(**request), timeout=60)
    state = wait_until(lambda: (s := estimate(worker)).num_waiting == 1 and s)
    assert state.num_running == 1
    # The first request already published two full blocks of the same prompt: 8 of 40 tokens remain.
    assert state.waiting_decode_tokens == 900 and state.waiting_prefill_tokens == 8
    assert 0 < state.running_decode_tokens < 900
    assert state.pending_decode_tokens == state.running_decode_tokens + 900
    assert state.pending_prefill_tokens == 8 + state.running_prefill_tokens

    with pytest.raises(grpc.RpcError) as info:  # the queue holds one request
        generate(worker.stub, **request)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    wait_until(lambda: estimate(worker).running_decode_tokens < state.running_decode_tokens)
    first.cancel()
    state = wait_until(lambda: (s := estimate(worker)).num_waiting == 0 and s.num_running == 1 and s)
    assert state.waiting_decode_tokens == 0 and state.running_decode_tokens <= 900
    second.cancel()
    state = wait_until(lambda: (s := estimate(worker)).num_running == 0 and s)
    assert (state.pending_prefill_tokens, state.pending_decode_tokens, state.kv_blocks_used) == (0, 0, 0)


def test_a_queued_request_gets_its_headers_before_any_token(single_slot_worker):
    """A proxy in front of the worker learns the call was taken at once, not together with the first token."""
    worker = single_slot_worker
    request = worker_pb2.GenerateRequest(prompt_token_ids=ids(list(range(40))), max_new_tokens=900, sampling=GREEDY,
                                         ignore_eos=True)
    running = worker.stub.Generate(request, timeout=60)
    next(running)
    queued = worker.stub.Generate(request, timeout=60)
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(queued.initial_metadata).result(timeout=10)
        assert estimate(worker).num_waiting == 1  # still queued behind the running request: no token yet
    finally:
        running.cancel()
        queued.cancel()
        pool.shutdown()
    wait_until(lambda: estimate(worker).num_running == 0)


