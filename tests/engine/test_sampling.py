"""The sampler's logit processing and log-probabilities, in the sampler alone and through the engine against
transformers' own forward pass."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.sampler import sample
from tandem.engine.request import Request
from tandem.sampling import SamplingParams
from tests.engine.helpers import (GREEDY, assert_no_leaks, greedy_request, hf_logprobs, make_engine, output_tokens,
                                  random_prompt, run_to_completion)

VOCAB = 8


def request_with(params: SamplingParams, prompt=(1, 2), output=(), **kwargs) -> Request:
    request = Request("r", list(prompt), 16, params, **kwargs)
    request.token_ids.extend(output)
    return request


def greedy_pick(logits: list[float], request: Request, eos=()) -> int:
    return sample(torch.tensor([logits]), [request], eos)[0].token_id


# --- the sampler alone -----------------------------------------------------------------------------------

LOGITS = [0.0, 1.0, 2.0, 3.0, 2.5, 0.5, 0.0, -1.0]  # token 3 is the most likely, then 4, then 2


def test_greedy_without_processing_takes_the_most_likely_token():
    assert greedy_pick(LOGITS, request_with(GREEDY)) == 3


def test_greedy_takes_the_first_of_tied_tokens_as_argmax_does():
    tied = [0.0, 3.0, 1.0, 3.0, 3.0, 0.0, 0.0, 0.0]
    assert greedy_pick(tied, request_with(GREEDY)) == 1
    wide = torch.zeros(4, 49152)
    wide[:, [40000, 9000, 30000]] = 7.0
    assert [s.token_id for s in sample(wide, [request_with(GREEDY)] * 4, ())] == [9000] * 4


def test_logit_bias_moves_the_choice():
    assert greedy_pick(LOGITS, request_with(SamplingParams(temperature=0, logit_bias={6: 5.0}))) == 6
    assert greedy_pick(LOGITS, request_with(SamplingParams(temperature=0, logit_bias={3: -1.0}))) == 4


def test_allowed_token_ids_limit_the_choice_before_the_bias():
    only = SamplingParams(temperature=0, allowed_token_ids=frozenset({0, 6}))
    assert greedy_pick(LOGITS, request_with(only)) == 0
    assert greedy_pick(LOGITS, request_with(SamplingParams(temperature=0, allowed_token_ids=frozenset({0, 6}),
                                                           logit_bias={6: 2.0}))) == 6
    sampled = SamplingParams(temperature=1.0, allowed_token_ids=frozenset({5, 7}), seed=0)
    assert {greedy_pick(LOGITS, request_with(sampled)) for _ in range(30)} <= {5, 7}


def test_presence_penalty_counts_a_generated_token_once_and_frequency_penalty_per_time():
    presence = SamplingParams(temperature=0, presence_penalty=0.6)
    assert greedy_pick(LOGITS, request_with(presence, output=[3])) == 4  # 3.0 - 0.6 < 2.5
    assert greedy_pick(LOGITS, request_with(presence, output=[3, 3, 3])) == 4
    frequency = SamplingParams(temperature=0, frequency_penalty=0.3)
    assert greedy_pick(LOGITS, request_with(frequency, output=[3])) == 3  # 2.7 > 2.5
    assert greedy_pick(LOGITS, request_with(frequency, output=[3, 3])) == 4  # 2.4 < 2.5
    assert greedy_pick(LOGITS, request_with(presence, prompt=[3], output=[])) == 3  # the prompt is not counted


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert greedy_pick(LOGITS, request_with(penalised, prompt=[3])) == 4  # 3.0 / 2 < 2.5
    assert greedy_pick(LOGITS, request_with(penalised, prompt=[0], output=[3, 4])) == 2
    negative = [-1.0, -2.0, -0.5, -3.0, -4.0, -5.0, -6.0, -7.0]
    assert greedy_pick(negative, request_with(penalised, prompt=[2])) == 0  # -0.5 * 2 < -1.0


def test_min_tokens_bans_the_end_of_sequence_and_stop_tokens_until_reached():
    params = SamplingParams(temperature=0, min_tokens=2)
    assert greedy_pick(LOGITS, request_with(params), eos={3}) == 4
    assert greedy_pick(LOGITS, request_with(params, stop_token_ids=frozenset({3, 4})), eos=()) == 2
    assert greedy_pick(LOGITS, request_with(params, ignore_eos=True), eos={3}) == 3
    assert greedy_pick(LOGITS, request_with(params, output=[1, 1]), eos={3}) == 3


def test_min_p_keeps_only_tokens_near_the_most_likely():
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=0)
    drawn = {greedy_pick(LOGITS, request_with(params)) for _ in range(50)}
    assert drawn <= {3, 4} and drawn  # p(4)/p(3) = e^-0.5 > 0.5; p(2)/p(3) = e^-1 < 0.5


def test_logprobs_are_the_models_own_with_rank_and_top_alternatives():
    params = SamplingParams(temperature=0, logprobs=2, presence_penalty=2.0)
    result = sample(torch.tensor([LOGITS]), [request_with(params, output=[3])], ())[0]
    expected = torch.log_softmax(torch.tensor(LOGITS), dim=-1)
    assert result.token_id == 4  # the penalty moved the choice ...
    assert result.logprobs.logprob == pytest.approx(float(expected[4]))  # ... not the reported distribution
    assert result.logprobs.rank == 2
    assert [token for token, _ in result.logprobs.top] == [3, 4]
    assert [value for _, value in result.logprobs.top] == pytest.approx([float(expected[3]), float(expected[4])])


def test_requests_without_processing_leave_a_batch_as_it_was():
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    plain, biased = request_with(GREEDY), request_with(SamplingParams(temperature=0, logit_bias={0: 10.0}))
    assert [s.token_id for s in sample(logits, [plain, biased], ())] == [3, 0]
    assert [s.token_id for s in sample(logits, [plain, request_with(GREEDY)], ())] == [3, 4]


# --- through the engine --------------------------------------------------------------------------------

def test_generated_token_logprobs_match_transformers(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 12, seed=1)
    engine.add_request(Request("lp", prompt, 6, SamplingParams(temperature=0, logprobs=3), ignore_eos=True))
    outputs = run_to_completion(engine)["lp"]
    tokens = output_tokens(outputs)
    logprobs = [lp for output in outputs for lp in output.logprobs]
    expected = hf_logprobs(tiny_llama, prompt + tokens)
    assert len(logprobs) == len(tokens) == 6
    for index, (token, position) in enumerate(zip(tokens, logprobs)):
        row = expected[len(prompt) - 1 + index]
        assert position.token_id == token and position.rank == 1  # greedy takes the most likely
        assert position.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t for t, _ in position.top] == row.topk(3).indices.tolist()
    assert_no_leaks(engine)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 8])  # whole, and in chunks of 8
def test_prompt_logprobs_match_transformers_even_when_the_prompt_is_cached(tiny_llama, max_num_batched_tokens):
    engine = make_engine(tiny_llama, max_num_batched_tokens=max_num_batched_tokens)
    prompt = random_prompt(engine, 40, seed=2)
    engine.add_request(greedy_request("warm", prompt, 2))  # puts the prompt's blocks in the prefix cache
    run_to_completion(engine)
    engine.add_request(Request("echo", prompt, 2, SamplingParams(temperature=0, prompt_logprobs=2), ignore_eos=True))
    outputs = run_to_completion(engine)["echo"]
    assert [len(output.prompt_logprobs) for output in outputs] == [len(prompt) - 1, 0]
    expected = hf_logprobs(tiny_llama, prompt)
    for position, (token, logprob) in enumerate(zip(prompt[1:], outputs[0].prompt_logprobs)):
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert [t for t, _ in logprob.top] == expected[position].topk(2).indices.tolist()
    assert outputs[-1].stats.num_cached_tokens == 0  # computed, not served from the cache
    assert_no_leaks(engine)


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 8, seed=3)
    engine.add_request(greedy_request("free", prompt, 6))
    first = output_tokens(run_to_completion(engine)["free"])[0]
    engine.add_request(Request("stopped", prompt, 6, GREEDY, stop_token_ids=frozenset({first})))
    engine.add_request(Request("held", prompt, 6, SamplingParams(temperature=0, min_tokens=3),
                               stop_token_ids=frozenset({first})))
    outputs = run_to_completion(engine)
    assert output_tokens(outputs["stopped"]) == [first]
    held = output_tokens(outputs["held"])
    assert len(held) >= 3 and first not in held[:3]
    assert_no_leaks(engine)


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 8, seed=4)
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, presence_penalty=0.5, repetition_penalty=1.2)
    engine.add_request(Request("alone", prompt, 10, params, ignore_eos=True))
    alone = output_tokens(run_to_completion(engine)["alone"])
    engine.add_request(Request("batched", prompt, 10, params, ignore_eos=True))
    for index in range(3):
        engine.add_request(Request(f"other{index}", random_prompt(engine, 8, seed=10 + index), 10,
                                   SamplingParams(temperature=1.0, frequency_penalty=1.0), ignore_eos=True))
    assert output_tokens(run_to_completion(engine)["batched"]) == alone
    assert_no_leaks(engine)


def test_seeded_samples_of_one_prompt_draw_as_requests_seeded_seed_plus_index(tiny_llama):
    params = SamplingParams(temperature=1.0, seed=11)
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 12, seed=8)
    samples = Request("s", prompt, 10, params, ignore_eos=True).samples(3)
    for sample in samples:
        engine.add_request(sample)
    together = run_to_completion(engine)
    for index, sample in enumerate(samples):
        alone = make_engine(tiny_llama)
        alone.add_request(Request("alone", prompt, 10, SamplingParams(temperature=1.0, seed=11 + index),
                                  ignore_eos=True))
        assert output_tokens(together[sample.req_id]) == output_tokens(run_to_completion(alone)["alone"])
    assert len({tuple(output_tokens(together[sample.req_id])) for sample in samples}) == 3
