"""The worker API on both engines: Tandem's own and vLLM's (the real vLLM, its CPU build), called over gRPC.

Each test runs once per engine against a worker process serving the same tiny float32 model, and asks the
same of both: the router relies on nothing else.
"""

from __future__ import annotations

import json
import random
import re
import time

import grpc
import pytest

from tandem.v1 import common_pb2, worker_pb2
from tests.engine.helpers import hf_greedy, hf_logprobs
from tests.integration.engines import BLOCK_SIZE, ENGINES, LONG_OUTPUT, engine_worker, running_engine_worker
from tandem.launch import free_port
from tests.integration.workers import (NOT_SERVING, SERVING, alive, descendants, scrape_metrics, stalled,
                                      wait_until)

GREEDY = common_pb2.SamplingParams(temperature=0)


@pytest.fixture(scope="module", params=ENGINES)
def worker(request, tiny_llama_64, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"worker-{request.param}") / "worker.log"
    with running_engine_worker(request.param, tiny_llama_64, log, "--max-active", "4",
                               "--metrics-port", str(free_port())) as process:
        process.engine = request.param
        yield process
        started = descendants(process.process.pid)
        assert started or request.param == "tandem", "vLLM runs its engine core in processes of its own"
    wait_until(lambda: not [pid for pid in started if alive(pid)])  # SIGKILL for the worker's whole group


def ids(values) -> worker_pb2.TokenIds:
    return worker_pb2.TokenIds(ids=values)


def generate(worker, timeout: float = 60, **fields) -> list[worker_pb2.GenerateResponse]:
    return list(worker.stub.Generate(worker_pb2.GenerateRequest(**fields), timeout=timeout))


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def estimate(worker, prompt=()) -> common_pb2.BackendState:
    return worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=list(prompt)), timeout=5)


def idle(worker) -> common_pb2.BackendState:
    """The worker's state once nothing runs, waits or holds KV blocks (fails the test if that never comes)."""
    return wait_until(lambda: (s := estimate(worker)).num_running == 0 and s.num_waiting == 0
                      and s.kv_blocks_used == 0 and not s.requests and s)


def test_the_stream_matches_transformers_greedy_output_token_for_token(worker, tiny_llama_64):
    for prompt in (list(range(10, 40)), list(range(200, 290)), [5, 17, 99, 3]):
        responses = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=12, sampling=GREEDY, ignore_eos=True)
        assert tokens_of(responses) == hf_greedy(tiny_llama_64, prompt, 12)
        result = responses[-1].result
        assert result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (result.usage.prompt_tokens, result.usage.output_tokens) == (len(prompt), 12)
        assert 0 <= result.timings.queue_time_s <= result.timings.ttft_s <= result.timings.total_time_s
        assert not any(r.HasField("result") for r in responses[:-1])


def test_the_worker_names_its_engine_and_reports_its_limits(worker):
    info = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    state = estimate(worker)
    assert info.engine == state.engine == worker.engine and info.engine_version == state.engine_version != ""
    assert info.block_size == state.block_size == BLOCK_SIZE
    assert info.max_active_requests == state.max_active_requests == 4
    # the defaults; vLLM's engine has one step budget
    assert (info.max_num_batched_tokens, info.max_prefill_step_tokens) == \
        ((512, 4096) if worker.engine == "tandem" else (512, 512))
    assert info.kv_blocks_total == state.kv_blocks_total > 0
    assert (info.vocab_size, info.context_length, info.dtype) == (400, 8192, "float32")
    assert state.rates.prefill_tokens_per_s > 0 and state.rates.decode_tokens_per_s > 0
    assert state.rates.calibration_steps >= 4
    assert state.serving_state == common_pb2.SERVING_STATE_SERVING and state.device == "cpu"


def test_the_prefix_cache_is_reported_as_the_engine_uses_it(worker):
    prefix = list(range(100, 196))  # three full blocks
    generate(worker, prompt_token_ids=ids(prefix + [5]), max_new_tokens=2, sampling=GREEDY, ignore_eos=True)
    state = wait_until(lambda: (s := estimate(worker, prefix + [7, 8])).cached_tokens == 96 and s)
    assert state.cached_tokens_evictable == 96  # the request is done: nothing holds the blocks
    responses = generate(worker, prompt_token_ids=ids(prefix + [7, 8]), max_new_tokens=2, sampling=GREEDY,
                         ignore_eos=True)
    assert responses[-1].result.usage.cached_tokens == 96
    assert estimate(worker, prefix[:64] + [1]).cached_tokens == 64


def test_watch_state_sends_the_index_whole_then_what_changes(worker):
    call = worker.stub.WatchState(worker_pb2.WatchStateRequest(interval_s=0.05, prefix_cache_changes=True), timeout=30)
    try:
        listing = next(call).prefix_cache_changes
        assert listing.reset and not listing.continued
        known = set(listing.held) | set(listing.free)
        prompt = list(range(300, 364)) + [1]  # two new full blocks
        generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=1, sampling=GREEDY, ignore_eos=True)
        added: set[bytes] = set()
        deadline = time.monotonic() + 10
        while len(added) < 2 and time.monotonic() < deadline:
            changes = next(call).prefix_cache_changes
            assert not changes.reset
            added |= (set(changes.held) | set(changes.free)) - known
        assert len(added) == 2
    finally:
        call.cancel()


def test_cancel_mid_stream_frees_everything(worker):
    # vLLM's engine core, stopped before the request is sent and let run a few milliseconds at a time, cannot
    # run it to its end (vLLM decodes ahead of the worker's delivery) before it is cancelled mid-stream.
    with stalled(worker) as stall:
        call = worker.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=ids(list(range(50))),
                                                               max_new_tokens=LONG_OUTPUT, sampling=GREEDY,
                                                               ignore_eos=True), timeout=60)
        try:  # running, with tokens generated: the stream has begun
            stall.step_until(lambda: (s := estimate(worker)).num_running == 1
                             and s.requests[0].decode_tokens < LONG_OUTPUT)
        finally:
            call.cancel()
    state = idle(worker)
    assert state.pending_decode_tokens == 0 and state.pending_prefill_tokens == 0
    assert len(generate(worker, prompt_token_ids=ids([1, 2, 3]), max_new_tokens=3, ignore_eos=True)) > 0


def test_a_deadline_aborts_the_request_in_the_engine(worker):
    with stalled(worker), pytest.raises(grpc.RpcError) as info:  # else vLLM may decode the 900 tokens within 0.3 s
        generate(worker, timeout=0.3, prompt_token_ids=ids(list(range(50))), max_new_tokens=900, sampling=GREEDY,
                 ignore_eos=True)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    idle(worker)


def test_stop_token_ids_and_stop_strings_end_the_stream(worker):
    prompt = list(range(60, 80))
    reference = tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=16, sampling=GREEDY,
                                   ignore_eos=True))
    stop_token = reference[5]
    responses = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=16, sampling=GREEDY, ignore_eos=True,
                         stop_token_ids=[stop_token])
    assert tokens_of(responses) == reference[:reference.index(stop_token) + 1]
    assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_STOP
    text = "".join(r.text for r in generate(worker, prompt_text="The quick brown fox", max_new_tokens=16,
                                            sampling=GREEDY, ignore_eos=True))
    stop = text.strip()[:2]
    stopped = generate(worker, prompt_text="The quick brown fox", max_new_tokens=16, sampling=GREEDY,
                       ignore_eos=True, stop=[stop])
    assert stop not in "".join(r.text for r in stopped)
    assert stopped[-1].result.finish_reason == common_pb2.FINISH_REASON_STOP
    kept = generate(worker, prompt_text="The quick brown fox", max_new_tokens=16, sampling=GREEDY, ignore_eos=True,
                    stop=[stop], include_stop_string=True)
    assert "".join(r.text for r in kept) == "".join(r.text for r in stopped) + stop


def test_special_tokens_add_text_only_when_kept(worker):
    eos = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).eos_token_ids[0]
    forced = common_pb2.SamplingParams(temperature=0, logit_bias={eos: 100.0})
    request = dict(prompt_token_ids=ids(list(range(20, 30))), max_new_tokens=3, sampling=forced, ignore_eos=True)
    assert tokens_of(generate(worker, **request)) == [eos] * 3
    assert "".join(r.text for r in generate(worker, **request)) == ""
    assert "".join(r.text for r in generate(worker, keep_special_tokens=True, **request)) == "</s>" * 3


def test_a_seeded_sample_repeats(worker):
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = list(range(20, 40))
    runs = [tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=24, sampling=sampling,
                               ignore_eos=True)) for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=24, sampling=GREEDY,
                                ignore_eos=True))
    assert runs[0] != greedy  # it sampled


def test_samples_of_one_prompt_share_its_computed_blocks(worker, tiny_llama_64):
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE + 5))
    responses = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=6, sampling=GREEDY, ignore_eos=True, n=3)
    by_sample = {index: [r for r in responses if r.index == index] for index in range(3)}
    assert [tokens_of(by_sample[index]) for index in range(3)] == [hf_greedy(tiny_llama_64, prompt, 6)] * 3
    results = [by_sample[index][-1].result for index in range(3)]
    assert [r.usage.output_tokens for r in results] == [6, 6, 6]
    # The samples after the first find its three full blocks computed.
    assert [r.usage.cached_tokens for r in results[1:]] == [3 * BLOCK_SIZE] * 2
    sampled = common_pb2.SamplingParams(temperature=1.0, seed=77)
    samples = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=12, sampling=sampled, ignore_eos=True, n=2)
    second = tokens_of(r for r in samples if r.index == 1)
    alone = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=12, ignore_eos=True,
                     sampling=common_pb2.SamplingParams(temperature=1.0, seed=78))
    assert second == tokens_of(alone) != tokens_of(r for r in samples if r.index == 0)
    idle(worker)


def test_structured_outputs_hold_the_output_on_both_engines(worker):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    specs = [(common_pb2.StructuredOutput(json_schema=json.dumps(schema)),
              lambda text: set(json.loads(text)) == {"ok", "n"}),
             (common_pb2.StructuredOutput(regex="[a-f]{4}"), lambda text: re.fullmatch("[a-f]{4}", text)),
             (common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["left", "right"])),
              lambda text: text in ("left", "right"))]
    for spec, check in specs:
        sampling = common_pb2.SamplingParams(temperature=0, structured_output=spec)
        responses = generate(worker, prompt_token_ids=ids(list(range(40, 60))), max_new_tokens=100, sampling=sampling)
        text = "".join(r.text for r in responses)
        assert check(text), text
        assert responses[-1].result.finish_reason in (common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP)
    with pytest.raises(grpc.RpcError) as info:
        generate(worker, prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(
            structured_output=common_pb2.StructuredOutput(regex="((")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.structured_output.regex:"), info.value.details()
    idle(worker)


def test_logprobs_and_prompt_logprobs_match_transformers_on_both_engines(worker, tiny_llama_64):
    prompt = list(range(30, 50))
    sampling = common_pb2.SamplingParams(temperature=0, logprobs=2, prompt_logprobs=1)
    responses = generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=5, sampling=sampling, ignore_eos=True)
    tokens = tokens_of(responses)
    generated = [lp for r in responses for lp in r.logprobs]
    prompt_logprobs = [lp for r in responses for lp in r.prompt_logprobs]
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    expected = hf_logprobs(tiny_llama_64, prompt + tokens)
    assert len(prompt_logprobs) == len(prompt) - 1 and len(generated) == 5
    for position, (token, logprob) in enumerate(zip(prompt[1:] + tokens, prompt_logprobs + generated)):
        assert logprob.logprob == pytest.approx(float(expected[position, token]), abs=1e-3)
        assert [t.token_id for t in logprob.top] == expected[position].topk(len(logprob.top)).indices.tolist()
    assert all(lp.rank == 1 and len(lp.top) == 2 for lp in generated)
    assert all(len(lp.top) == 1 for lp in prompt_logprobs)
    idle(worker)


def test_penalties_bias_and_min_tokens_on_both_engines(worker, tiny_llama_64):
    prompt = list(range(60, 80))
    plain = tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=8, sampling=GREEDY, ignore_eos=True))
    neutral = common_pb2.SamplingParams(temperature=0, presence_penalty=0, frequency_penalty=0, repetition_penalty=1,
                                        min_p=0, min_tokens=0)
    assert tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=8, sampling=neutral,
                              ignore_eos=True)) == plain
    biased = common_pb2.SamplingParams(temperature=0, logit_bias={7: 100.0})
    assert tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=4, sampling=biased,
                              ignore_eos=True)) == [7] * 4
    penalised = common_pb2.SamplingParams(temperature=0, logit_bias={7: 5.0}, frequency_penalty=2.0,
                                          presence_penalty=2.0, repetition_penalty=2.0)
    output = tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=8, sampling=penalised,
                                ignore_eos=True))
    assert output.count(7) < 8
    allowed = common_pb2.SamplingParams(temperature=0, allowed_token_ids=[11, 12])
    assert set(tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=6, sampling=allowed,
                                  ignore_eos=True))) <= {11, 12}
    held = common_pb2.SamplingParams(temperature=0, min_tokens=4)
    output = tokens_of(generate(worker, prompt_token_ids=ids(prompt), max_new_tokens=8, sampling=held,
                                stop_token_ids=[plain[0]]))
    assert len(output) >= 4 and plain[0] not in output[:4]
    idle(worker)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        (dict(prompt_token_ids=ids([]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (dict(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompt_token_ids=ids([1, 99999]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=9000), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(top_p=1.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(temperature=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, stop_token_ids=[123456]), grpc.StatusCode.INVALID_ARGUMENT,
         "stop_token_ids"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, request_id="r" * 300), grpc.StatusCode.INVALID_ARGUMENT,
         "request_id"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(logprobs=21)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(
            presence_penalty=3)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(
            logit_bias={5000: 1.0})), grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(min_tokens=5)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_tokens"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, sampling=common_pb2.SamplingParams(
            allowed_token_ids=[5000])), grpc.StatusCode.INVALID_ARGUMENT, "sampling.allowed_token_ids"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, n=17), grpc.StatusCode.INVALID_ARGUMENT, "n"),
        (dict(prompt_token_ids=ids([1, 2]), max_new_tokens=4, n=-1), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ],
)
def test_invalid_input_gets_the_same_status_and_field_on_both_engines(worker, fields, code, field):
    with pytest.raises(grpc.RpcError) as info:
        generate(worker, **fields)
    assert info.value.code() == code
    assert info.value.details().startswith(field + ":"), info.value.details()
    assert worker.health_status() == SERVING
    idle(worker)


def test_a_request_id_in_flight_cannot_be_reused(worker):
    with stalled(worker):  # "twice" stays in flight however fast the engine would finish it
        call = worker.stub.Generate(worker_pb2.GenerateRequest(request_id="twice", prompt_token_ids=ids(list(range(30))),
                                                               max_new_tokens=500, ignore_eos=True), timeout=60)
        wait_until(lambda: [r.request_id for r in estimate(worker).requests] == ["twice"])
        with pytest.raises(grpc.RpcError) as info:
            generate(worker, request_id="twice", prompt_token_ids=ids([1, 2]), max_new_tokens=2)
        call.cancel()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("request_id:")
    idle(worker)


def test_the_queue_and_budgets_are_reported_per_request(worker):
    prompts = [[random.Random(i).randrange(400) for _ in range(40)] for i in range(6)]
    calls = []
    try:
        with stalled(worker) as stall:  # vLLM's engine core, let run a few milliseconds at a time
            for i, prompt in enumerate(prompts):
                calls.append(worker.stub.Generate(worker_pb2.GenerateRequest(
                    request_id=f"load-{i}", prompt_token_ids=ids(prompt), max_new_tokens=LONG_OUTPUT,
                    ignore_eos=True), timeout=60))
            state = stall.step_until(lambda: (s := estimate(worker)).num_running == 4 and s.num_waiting == 2 and s)
        assert {r.request_id for r in state.requests} == {f"load-{i}" for i in range(6)}
        assert [r.running for r in state.requests] == [True] * 4 + [False] * 2
        assert all(0 < r.decode_tokens <= LONG_OUTPUT for r in state.requests)
        assert all(r.prefill_tokens == 40 for r in state.requests if not r.running)
        assert state.pending_decode_tokens == sum(r.decode_tokens for r in state.requests)
        assert state.kv_blocks_used > 0
    finally:
        for call in calls:
            call.cancel()
    idle(worker)


def settled_metrics(worker) -> dict:
    """The worker's metrics once a step that earlier tests ran is no longer being recorded: a vLLM engine core
    that a test stalled can take more than 15 s on a loaded machine to record its last steps."""
    idle(worker)
    def unchanged():
        first = scrape_metrics(worker)
        time.sleep(0.3)
        return first if scrape_metrics(worker) == first else None
    return wait_until(unchanged, timeout=45)


def test_metrics_parse_and_move_after_requests(worker):
    before = settled_metrics(worker)
    for i in range(3):
        generate(worker, prompt_token_ids=ids([7, 8, 9, i]), max_new_tokens=4, sampling=GREEDY, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        generate(worker, prompt_token_ids=ids([]), max_new_tokens=4)
    steps = ("tandem_worker_step_batch_size_count", ())

    refused = ("tandem_worker_rpcs_total", (("code", "INVALID_ARGUMENT"), ("method", "Generate")))

    def every_step_recorded():  # a step, and an RPC's status, are recorded just after the reply goes out
        metrics = scrape_metrics(worker)
        moved = metrics.get(steps, 0.0) - before.get(steps, 0.0) >= 12 and metrics.get(refused, 0.0) > before.get(refused, 0.0)
        return metrics if moved else None

    after = wait_until(every_step_recorded, timeout=10)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tandem_worker_requests_finished_total", finish_reason="length") == 3
    assert delta("tandem_worker_time_to_first_token_seconds_count") == 3
    assert delta("tandem_worker_e2e_request_latency_seconds_count") == 3
    assert delta("tandem_worker_time_per_output_token_seconds_count") == 3
    assert delta("tandem_worker_rpcs_total", method="Generate", code="OK") == 3
    assert delta("tandem_worker_rpcs_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("tandem_worker_prefix_cache_queried_tokens_total") == 12
    # Each request ran alone: one prefill step that samples the first token, then three decode steps.
    assert delta("tandem_worker_output_tokens_count") == 3 and delta("tandem_worker_output_tokens_sum") == 12
    assert delta("tandem_worker_output_tokens_bucket", le="4.0") == 3
    assert delta("tandem_worker_output_tokens_bucket", le="1.0") == 0
    assert delta("tandem_worker_step_batch_size_count") == 12 and delta("tandem_worker_step_batch_size_sum") == 12
    assert delta("tandem_worker_step_batch_size_bucket", le="1.0") == 12
    assert after[("tandem_worker_requests_running", ())] == 0
    blocks = sum(after[("tandem_worker_kv_blocks", (("state", s),))] for s in ("used", "cached", "free"))
    assert blocks == estimate(worker).kv_blocks_total
    assert after[("tandem_worker_decode_tokens_per_second", ())] > 0


# Long enough that Tandem's engine (which cannot be stalled) is still decoding when the refusal is checked.
DRAINED_OUTPUT = 2000


@pytest.mark.parametrize("engine", ENGINES)
def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(engine, tiny_llama_64, tmp_path):
    process = engine_worker(engine, tiny_llama_64, tmp_path / "worker.log")
    try:
        process.wait_for_health(SERVING)
        started = descendants(process.process.pid)
        # vLLM's engine core, stopped before the stream is sent, cannot run it to its end (vLLM decodes ahead of
        # the worker's delivery) before the refusal is checked; the stream is in flight once the worker queues it.
        with stalled(process):
            stream = process.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=ids(list(range(20))),
                                                                      max_new_tokens=DRAINED_OUTPUT, sampling=GREEDY,
                                                                      ignore_eos=True), timeout=120)
            wait_until(lambda: estimate(process).requests)
            process.process.send_signal(15)
            process.wait_for_health(NOT_SERVING, timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                generate(process, prompt_token_ids=ids([1, 2]), max_new_tokens=2, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        responses = list(stream)
        assert len(tokens_of(responses)) == DRAINED_OUTPUT
        assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert process.process.wait(60) == 0
        wait_until(lambda: not [pid for pid in started if alive(pid)], timeout=10)  # vLLM kills its engine core last
    finally:
        process.close()
