"""The router's learned output lengths (router_svc/output_lengths.py) and how the policies price them."""

from __future__ import annotations

import pytest

from router_svc.output_lengths import OVERALL, PRIOR_SAMPLES, OutputLengths, check_length_key
from router_svc.policies import RouteInput, cost_score, finish_time_score
from router_svc.worker_view import QueuedWork
from tandem.errors import InvalidRequestError
from tests.unit.test_policy import make_view


def test_a_new_key_is_priced_at_its_whole_budget():
    lengths = OutputLengths()
    assert lengths.fraction("chat") == lengths.fraction() == 1.0
    assert lengths.expected_tokens("chat", 128) == 128


def test_the_figure_moves_from_the_budget_to_what_requests_use():
    lengths = OutputLengths()
    lengths.observe("chat", 32, 128)  # a quarter of the budget
    assert lengths.fraction("chat") == pytest.approx((0.25 + PRIOR_SAMPLES) / (1 + PRIOR_SAMPLES))
    for _ in range(400):
        lengths.observe("chat", 32, 128)
    assert lengths.fraction("chat") == pytest.approx(0.25, abs=0.01)
    assert lengths.expected_tokens("chat", 128) == pytest.approx(32, abs=2)


def test_keys_are_learned_apart_and_a_key_without_samples_borrows_the_overall_figure():
    lengths = OutputLengths()
    for _ in range(200):
        lengths.observe("summaries", 10, 100)
        lengths.observe("essays", 100, 100)
    assert lengths.fraction("summaries") < 0.2 < 0.9 < lengths.fraction("essays")
    assert lengths.fraction("unseen") == lengths.fraction(OVERALL)
    assert 0.4 < lengths.fraction(OVERALL) < 0.7
    assert lengths.expected_tokens("summaries", 1) == 1  # never below one token, never above the budget


def test_the_least_recently_used_key_is_forgotten_and_reported():
    updates = []
    lengths = OutputLengths(max_keys=2, on_update=lambda key, fraction, samples: updates.append((key, fraction)))
    lengths.observe("a", 1, 10)
    lengths.observe("b", 1, 10)
    lengths.observe("a", 1, 10)  # a is now the most recently used
    lengths.observe("c", 1, 10)
    assert [learned.key for learned in lengths.learned()] == [OVERALL, "a", "c"]
    assert ("b", None) in updates
    assert [learned.samples for learned in lengths.learned()] == [4, 2, 1]


@pytest.mark.parametrize("key", ["x" * 129, "tab\there"])
def test_an_unusable_key_names_the_field(key):
    with pytest.raises(InvalidRequestError, match="^length_key: must be at most 128 printable"):
        check_length_key("length_key", key)


def test_cost_prices_the_expected_output_of_the_request_and_of_the_queue():
    view = make_view(pending_decode_tokens=400, num_running=4, decode_tok_s=100.0)
    budget = cost_score(view, RouteInput(prompt_tokens=10, max_new_tokens=100))
    learned = cost_score(view, RouteInput(prompt_tokens=10, max_new_tokens=100, expected_new_tokens=25,
                                          output_fraction=0.25))
    assert budget.decode_s == pytest.approx((400 + 100) / 100)
    assert learned.decode_s == pytest.approx((100 + 25) / 100)


def test_finish_time_plays_the_queue_forward_with_expected_outputs():
    fields = dict(step_base_s=0.01, step_per_prefill_token_s=1e-4, step_per_decode_s=1e-4, max_active_requests=1)
    view = make_view(queue=(QueuedWork(True, 0, 100),), **fields)
    budget = finish_time_score(view, RouteInput(prompt_tokens=8, max_new_tokens=40)).score
    learned = finish_time_score(view, RouteInput(prompt_tokens=8, max_new_tokens=40, expected_new_tokens=10,
                                                 output_fraction=0.1)).score
    # one slot: the running request's 100 (or 10) decodes, then the prefill, then 39 (or 9) decodes
    step = 0.01 + 1e-4
    assert budget == pytest.approx(100 * step + 0.01 + 8e-4 + 39 * step)
    assert learned == pytest.approx(10 * step + 0.01 + 8e-4 + 9 * step)
