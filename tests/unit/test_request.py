"""Unit tests for request state and sampling parameters."""

from __future__ import annotations

import math

import pytest

from tandem.errors import InvalidRequestError
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.sampling import SamplingParams
from tandem.engine.utils import cdiv

# --- SamplingParams ------------------------------------------------------------------------------


def test_default_sampling_params_are_valid_and_not_greedy():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
        {"temperature": 2, "top_p": 0.01, "top_k": 50},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"min_p": 0.0}, {"min_p": 1},
        {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 0.5},
        {"min_tokens": 0}, {"min_tokens": 10},
        {"logit_bias": {0: -100, 5: 100.0}},
        {"logprobs": 0, "prompt_logprobs": 20},
    ],
)
def test_valid_sampling_params_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": False}, "seed"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias.5"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.field == field
    assert str(excinfo.value).startswith(f"{field}:")
    assert isinstance(excinfo.value, ValueError)


# --- RequestStatus -------------------------------------------------------------------------------

FINISHED = [
    (RequestStatus.FINISHED_LENGTH, FinishReason.LENGTH),
    (RequestStatus.FINISHED_STOP, FinishReason.STOP),
    (RequestStatus.FINISHED_EOS, FinishReason.EOS),
    (RequestStatus.FINISHED_ABORTED, FinishReason.ABORTED),
    (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
]


@pytest.mark.parametrize(("status", "reason"), FINISHED)
def test_finished_statuses_sort_after_running_and_map_to_a_reason(status, reason):
    assert status > RequestStatus.RUNNING > RequestStatus.WAITING
    assert status.is_finished
    assert status.finish_reason is reason


def test_active_statuses_are_not_finished_and_have_no_reason():
    for status in (RequestStatus.WAITING, RequestStatus.RUNNING):
        assert not status.is_finished
        assert status.finish_reason is None


def test_every_status_is_covered():
    assert set(RequestStatus) == {RequestStatus.WAITING, RequestStatus.RUNNING} | {s for s, _ in FINISHED}
    assert {reason.value for _, reason in FINISHED} == {"length", "stop", "eos", "aborted", "error"}


# --- Request -------------------------------------------------------------------------------------


def test_new_request_starts_waiting_with_its_prompt():
    prompt = [5, 6, 7]
    request = Request("r", prompt, max_new_tokens=4)
    assert request.status is RequestStatus.WAITING
    assert request.finish_reason is None
    assert request.token_ids == prompt
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (3, 3, 0)
    assert request.decode_budget == 4

    request.token_ids.append(8)
    assert prompt == [5, 6, 7], "token_ids must be a copy of the prompt"
    assert request.prompt_token_ids == [5, 6, 7]


def test_output_counts_and_decode_budget_follow_generated_tokens():
    request = Request("r", [1, 2, 3], max_new_tokens=5)
    request.token_ids.extend([10, 11])
    assert request.num_tokens == 5
    assert request.num_output_tokens == 2
    assert request.output_token_ids == [10, 11]
    assert request.decode_budget == 3


def test_prefill_remaining_counts_uncomputed_prefill_tokens():
    request = Request("r", list(range(10)), max_new_tokens=2)
    assert request.prefill_remaining == 0, "nothing to prefill before admission sets num_prefill_tokens"
    request.num_prefill_tokens = 10
    assert request.prefill_remaining == 10
    request.num_computed_tokens = 6
    assert request.prefill_remaining == 4
    request.num_computed_tokens = 11  # decoding beyond the prefill
    assert request.prefill_remaining == 0


def test_finish_reason_follows_status():
    request = Request("r", [1], max_new_tokens=1)
    request.status = RequestStatus.FINISHED_EOS
    assert request.finish_reason is FinishReason.EOS


def test_requests_compare_by_identity():
    a = Request("same", [1], max_new_tokens=1, arrival_time=0.0)
    b = Request("same", [1], max_new_tokens=1, arrival_time=0.0)
    assert a != b
    assert len({a, b}) == 2


# --- block arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (2176, 16, 136)])
def test_cdiv_rounds_up(a, b, expected):
    assert cdiv(a, b) == expected


def test_required_blocks_cover_computed_and_new_tokens():
    request = Request("r", list(range(5)), max_new_tokens=4)
    assert [request.num_required_blocks(n, 4) for n in (1, 4, 5)] == [1, 1, 2]
    request.num_computed_tokens = 4
    assert request.num_required_blocks(1, 4) == 2
    assert request.num_computed_full_blocks(4) == 1
    request.num_computed_tokens = 3
    assert request.num_computed_full_blocks(4) == 0


def test_max_num_blocks_counts_prompt_and_full_output_budget():
    assert Request("r", list(range(5)), max_new_tokens=3).max_num_blocks(4) == 2
    assert Request("r", list(range(5)), max_new_tokens=4).max_num_blocks(4) == 3


def test_block_token_ids_slice_one_block_including_a_partial_last_one():
    request = Request("r", list(range(10)), max_new_tokens=1)
    assert request.block_token_ids(1, 4) == [4, 5, 6, 7]
    assert request.block_token_ids(2, 4) == [8, 9]
