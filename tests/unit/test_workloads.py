"""Workloads are explicit, seeded request lists; results summaries are plain arithmetic over records."""

from __future__ import annotations

import pytest

from tandem.loadgen.results import RequestRecord, percentile, summarize
from tandem.loadgen.workloads import long_context, poisson, seed_burst


def test_seed_burst_is_the_articles_setup():
    workload = seed_burst(8, 1000)
    assert len(workload.requests) == 8 and workload.warm_prefixes == (workload.requests[0].prompt_token_ids[:496],)
    assert [r.arrival_s for r in workload.requests] == pytest.approx([0.05 * i for i in range(8)])
    for request in workload.requests:
        assert len(request.prompt_token_ids) == 516
        assert request.prompt_token_ids[:496] == workload.warm_prefixes[0]
        assert request.max_new_tokens == request.output_tokens == 128
    assert len({r.prompt_token_ids[496:] for r in workload.requests}) == 8  # the 20-token suffixes differ


def test_seed_burst_with_short_outputs_keeps_the_budget():
    workload = seed_burst(200, 1000, output_fraction=0.5)
    outputs = [r.output_tokens for r in workload.requests]
    assert all(1 <= n <= 128 for n in outputs) and all(r.max_new_tokens == 128 for r in workload.requests)
    assert 50 < sum(outputs) / len(outputs) < 78


def test_poisson_draws_lengths_prefixes_and_arrivals_from_its_seed():
    workload = poisson(400, 1000, seed=3, rate_per_s=2.0, prefix_share=0.5, num_prefixes=4, prefix_tokens=64,
                       max_new_tokens=256, output_tokens_mean=32)
    assert workload == poisson(400, 1000, seed=3, rate_per_s=2.0, prefix_share=0.5, num_prefixes=4, prefix_tokens=64,
                               max_new_tokens=256, output_tokens_mean=32)
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals) and 150 < arrivals[-1] < 250  # 400 arrivals at 2/s
    shared = [r for r in workload.requests if r.prompt_token_ids[:64] in workload.warm_prefixes]
    assert 0.4 < len(shared) / 400 < 0.6 and len(workload.warm_prefixes) == 4
    outputs = [r.output_tokens for r in workload.requests]
    assert max(outputs) <= 256 and 25 < sum(outputs) / 400 < 40  # budgets far above the real lengths


def test_long_context_requests_share_nothing():
    workload = long_context(4, 1000, context_tokens=300)
    assert workload.warm_prefixes == ()
    assert len({r.prompt_token_ids[:16] for r in workload.requests}) == 4


@pytest.mark.parametrize("bad", [dict(prefix_tokens=516), dict(output_fraction=0), dict(max_new_tokens=0)])
def test_bad_workload_parameters_name_the_parameter(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        seed_burst(4, 1000, **bad)


def test_percentile_interpolates_between_ranks():
    assert percentile([3, 1, 2, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    assert percentile([], 50) is None


def test_summary_counts_makespan_from_the_first_submission():
    records = [
        RequestRecord("a", "gpu-0", 0.0, 0.5, 2.0, 10),
        RequestRecord("b", "cpu-0", 1.0, 1.5, 5.0, 5),
        RequestRecord("c", "gpu-0", 1.0, None, 1.0, 0, "RESOURCE_EXHAUSTED"),
    ]
    summary = summarize(records, ["gpu-0", "cpu-0", "cpu-1"])
    assert summary["makespan_s"] == 5.0 and summary["output_tok_s"] == 3.0
    assert summary["outcomes"] == {"OK": 2, "RESOURCE_EXHAUSTED": 1}
    assert summary["requests_per_worker"] == {"gpu-0": 1, "cpu-0": 1, "cpu-1": 0}
    assert summary["ttft_p50_s"] == 0.5 and summary["tpot_p50_s"] == pytest.approx((1.5 / 9 + 3.5 / 4) / 2)
