"""Request handling: validation, stops, sampling, the bounded queue and the state snapshot."""

from __future__ import annotations

import pytest

from tandem.engine.engine import LLMEngine
from tandem.errors import InvalidRequestError, QueueFullError
from tandem.engine.request import FinishReason, Request
from tandem.sampling import SamplingParams
from tests.engine.helpers import (
    GREEDY,
    assert_no_leaks,
    greedy_request,
    make_engine,
    output_tokens,
    random_prompt,
    run_to_completion,
)


@pytest.fixture
def engine(tiny_llama):
    return make_engine(tiny_llama)


@pytest.mark.parametrize(
    ("make_request", "field"),
    [
        (lambda p: Request("bad", [], 8, GREEDY), "prompt"),
        (lambda p: Request("bad", p[:5] + [10**9], 8, GREEDY), "prompt_token_ids"),
        (lambda p: Request("bad", p[:5] + [-1], 8, GREEDY), "prompt_token_ids"),
        (lambda p: Request("bad", p, 1024, GREEDY), "max_new_tokens"),
        (lambda p: Request("bad", p, 0, GREEDY), "max_new_tokens"),
        (lambda p: Request("bad", p, -3, GREEDY), "max_new_tokens"),
        (lambda p: Request("bad", p, 8, SamplingParams(temperature=-0.5)), "temperature"),
        (lambda p: Request("bad", p, 8, SamplingParams(top_p=0.0)), "top_p"),
        (lambda p: Request("bad", p, 8, SamplingParams(top_p=1.01)), "top_p"),
        (lambda p: Request("bad", p, 8, GREEDY, stop_token_ids=frozenset({10**7})), "stop_token_ids"),
        (lambda p: Request("bad", p, 8, SamplingParams(logit_bias={10**7: 1.0})), "sampling.logit_bias"),
        (lambda p: Request("bad", p, 8, SamplingParams(min_tokens=9)), "sampling.min_tokens"),
    ],
)
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, make_request, field):
    prompt = random_prompt(engine, 20, seed=1)
    engine.add_request(greedy_request("good", prompt, 6))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(make_request(prompt))
    assert info.value.field == field
    assert field in str(info.value)
    outputs = run_to_completion(engine)
    assert len(output_tokens(outputs["good"])) == 6
    assert outputs["good"][-1].finish_reason is FinishReason.LENGTH
    assert_no_leaks(engine)


def test_duplicate_request_id_is_rejected(engine):
    prompt = random_prompt(engine, 8, seed=2)
    engine.add_request(greedy_request("same", prompt, 4))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(greedy_request("same", prompt, 4))
    assert info.value.field == "request_id"


def test_waiting_queue_is_bounded(tiny_llama):
    engine = make_engine(tiny_llama, max_waiting_requests=2)
    prompt = random_prompt(engine, 8, seed=3)
    engine.add_request(greedy_request("a", prompt, 4))
    engine.add_request(greedy_request("b", prompt, 4))
    with pytest.raises(QueueFullError):
        engine.add_request(greedy_request("c", prompt, 4))
    assert set(run_to_completion(engine)) == {"a", "b"}
    assert_no_leaks(engine)


def test_stop_token_ids_eos_and_length(engine):
    prompt = random_prompt(engine, 12, seed=4)
    engine.add_request(greedy_request("free", prompt, 20))
    reference = output_tokens(run_to_completion(engine)["free"])

    stop_token = reference[6]
    engine.add_request(greedy_request("stop", prompt, 20, stop_token_ids=frozenset({stop_token})))
    engine.add_request(Request("eos", prompt, 20, GREEDY))  # EOS not ignored
    outputs = run_to_completion(engine)
    stopped = output_tokens(outputs["stop"])
    assert stopped == reference[: reference.index(stop_token) + 1]
    assert outputs["stop"][-1].finish_reason is FinishReason.STOP

    eos = engine.executor.eos_token_ids
    if any(token in eos for token in reference):
        first = next(i for i, token in enumerate(reference) if token in eos)
        assert output_tokens(outputs["eos"]) == reference[: first + 1]
        assert outputs["eos"][-1].finish_reason is FinishReason.EOS
    else:
        assert outputs["eos"][-1].finish_reason is FinishReason.LENGTH


def test_stop_string_cuts_text_before_it(engine):
    prompt = random_prompt(engine, 12, seed=5)
    engine.add_request(greedy_request("free", prompt, 30))
    outputs = run_to_completion(engine)["free"]
    full_text = "".join(o.text for o in outputs)
    assert full_text == engine.tokenizer.decode(output_tokens(outputs), skip_special_tokens=True)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"

    engine.add_request(greedy_request("cut", prompt, 30, stop_strings=(stop,)))
    cut = run_to_completion(engine)["cut"]
    text = "".join(o.text for o in cut)
    assert text == full_text[: full_text.index(stop)]
    assert cut[-1].finish_reason is FinishReason.STOP
    assert_no_leaks(engine)


def test_seeded_sampling_is_reproducible(engine):
    prompt = random_prompt(engine, 10, seed=6)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    engine.add_request(Request("a", prompt, 16, params, ignore_eos=True))
    engine.add_request(Request("b", prompt, 16, params, ignore_eos=True))
    for seed in range(3):
        engine.add_request(Request(f"other{seed}", prompt, 16, SamplingParams(temperature=1.0, seed=seed), ignore_eos=True))
    outputs = run_to_completion(engine)
    assert output_tokens(outputs["a"]) == output_tokens(outputs["b"])
    others = {tuple(output_tokens(outputs[f"other{seed}"])) for seed in range(3)}
    assert len(others | {tuple(output_tokens(outputs["a"]))}) > 1


def test_top_k_one_is_greedy(engine):
    prompt = random_prompt(engine, 10, seed=7)
    engine.add_request(greedy_request("greedy", prompt, 12))
    engine.add_request(Request("topk1", prompt, 12, SamplingParams(temperature=0.8, top_k=1, seed=3), ignore_eos=True))
    outputs = run_to_completion(engine)
    assert output_tokens(outputs["greedy"]) == output_tokens(outputs["topk1"])


def test_state_snapshot_counts_pending_work(tiny_llama):
    engine = make_engine(tiny_llama, max_active_requests=1)
    prefix = random_prompt(engine, 32, seed=8)
    engine.add_request(greedy_request("warm", prefix + [4], 2))
    run_to_completion(engine)

    seq_before = engine.state().seq
    engine.add_request(greedy_request("a", prefix + [5, 6], 10))
    engine.add_request(greedy_request("b", prefix + [7, 8, 9], 20))
    state = engine.state()
    assert state.seq > seq_before
    assert state.load.num_waiting == 2 and state.load.num_running == 0
    assert state.load.waiting_prefill_tokens == 2 + 3  # the cached 32-token prefix is discounted
    assert state.pending_decode_budget == 30

    engine.step()  # admits "a" only (max_active_requests=1)
    state = engine.state()
    assert (state.load.num_running, state.load.num_waiting) == (1, 1)
    assert state.load.running_decode_budget == 9
    assert state.load.waiting_decode_budget == 20
    assert state.load.num_used_blocks > 0
    run_to_completion(engine)
    state = engine.state()
    assert state.pending_prefill_tokens == 0 and state.pending_decode_budget == 0
    assert state.load.prefix_hit_tokens >= 64


def test_calibration_measures_rates_and_leaves_the_cache_clean(tiny_llama):
    engine = make_engine(tiny_llama)
    rates = engine.calibrate()
    assert rates.prefill_tok_s > 0 and rates.decode_tok_s > 0
    # two prefill shapes, two decode shapes, and the largest small step where it is neither of those
    largest_small_step = 1 < engine.executor.small_step_rows < engine.config.max_active_requests
    assert rates.num_calibration_steps == 4 + largest_small_step and rates.num_observed_steps == 0
    assert "calibrated" in rates.source
    assert engine.scheduler.pool.num_cached_free_blocks == 0
    assert_no_leaks(engine)
    engine.add_request(greedy_request("x", random_prompt(engine, 8, seed=9), 4))
    run_to_completion(engine)
    assert engine.rates.rates().num_observed_steps > 0


def test_request_times_come_from_the_engines_clock(tiny_llama):
    built = make_engine(tiny_llama)
    now = [100.0]
    engine = LLMEngine(built.executor, built.tokenizer, built.config, clock=lambda: now[0])
    engine.add_request(greedy_request("t", random_prompt(engine, 8, seed=11), 3, arrival_time=99.0))
    output = engine.schedule()
    now[0] = 102.5
    engine.process(output, engine.executor.execute(output), 0.01)
    now[0] = 110.0
    outputs = run_to_completion(engine)["t"]
    stats = outputs[-1].stats
    assert (stats.queue_time_s, stats.ttft_s, stats.total_time_s) == (1.0, 3.5, 11.0)


def test_a_step_sample_goes_where_the_caller_says(tiny_llama):
    engine = make_engine(tiny_llama)
    observed, samples = [], []
    engine.rates.observe = observed.append
    engine.add_request(greedy_request("s", random_prompt(engine, 8, seed=12), 2))
    engine.step(record_step=samples.append)
    assert [(s.num_prefill_tokens, s.num_decode_requests) for s in samples] == [(8, 0)]
    assert observed == []
    engine.step()
    assert [(s.num_prefill_tokens, s.num_decode_requests) for s in observed] == [(0, 1)]
    assert len(samples) == 1
