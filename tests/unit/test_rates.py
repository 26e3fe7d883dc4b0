"""Unit tests for the step-time model and the rates derived from it."""

from __future__ import annotations

import math

import pytest

from tandem.engine.rates import RateTracker, StepSample

BASE = 0.002
PER_TOKEN = 1e-5
PER_DECODE = 3e-4
GRID = [(p, d) for p in (0, 16, 64, 128, 256) for d in (0, 1, 4, 8) if p or d]


def step_time(prefill_tokens: int, decodes: int, base=BASE, per_token=PER_TOKEN, per_decode=PER_DECODE) -> float:
    return base + per_token * prefill_tokens + per_decode * decodes


def sample(prefill_tokens: int, decodes: int, **coefficients) -> StepSample:
    return StepSample(prefill_tokens, decodes, step_time(prefill_tokens, decodes, **coefficients))


def calibrated_tracker(window: int = 256) -> RateTracker:
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=8, window=window)
    for prefill_tokens, decodes in GRID:
        tracker.add_calibration(sample(prefill_tokens, decodes))
    return tracker


def assert_coefficients(rates, base, per_token, per_decode, rel=1e-6):
    assert rates.step_base_s == pytest.approx(base, rel=rel)
    assert rates.step_per_prefill_token_s == pytest.approx(per_token, rel=rel)
    assert rates.step_per_decode_s == pytest.approx(per_decode, rel=rel)


def test_exact_linear_data_recovers_the_coefficients():
    rates = calibrated_tracker().rates()
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)
    assert rates.num_calibration_steps == len(GRID)
    assert rates.num_observed_steps == 0
    assert (rates.reference_prefill_tokens, rates.reference_decode_batch) == (256, 8)


def test_a_minimal_well_posed_calibration_is_enough():
    tracker = RateTracker(reference_prefill_tokens=128, reference_decode_batch=4)
    for prefill_tokens, decodes in [(64, 0), (256, 0), (0, 1), (0, 8)]:
        tracker.add_calibration(sample(prefill_tokens, decodes))
    assert_coefficients(tracker.rates(), BASE, PER_TOKEN, PER_DECODE)


def test_throughputs_follow_the_documented_formulas():
    rates = calibrated_tracker().rates()
    assert rates.prefill_tok_s == pytest.approx(256 / (rates.step_base_s + rates.step_per_prefill_token_s * 256))
    assert rates.decode_tok_s == pytest.approx(8 / (rates.step_base_s + rates.step_per_decode_s * 8))
    # And so, against the true model:
    assert rates.prefill_tok_s == pytest.approx(256 / step_time(256, 0), rel=1e-6)
    assert rates.decode_tok_s == pytest.approx(8 / step_time(0, 8), rel=1e-6)


def test_observed_steps_shift_the_fit():
    tracker = calibrated_tracker()
    before = tracker.rates()
    for prefill_tokens, decodes in GRID * 3:
        tracker.observe(sample(prefill_tokens, decodes, per_token=2 * PER_TOKEN, per_decode=2 * PER_DECODE))
    after = tracker.rates()

    assert after.num_observed_steps == 3 * len(GRID)
    assert PER_TOKEN < after.step_per_prefill_token_s < 2 * PER_TOKEN
    assert PER_DECODE < after.step_per_decode_s < 2 * PER_DECODE
    assert after.prefill_tok_s < before.prefill_tok_s
    assert after.decode_tok_s < before.decode_tok_s


def test_the_window_bounds_the_observed_steps():
    window = 4
    tracker = calibrated_tracker(window=window)
    for _ in range(50):
        tracker.observe(sample(128, 4, per_token=10 * PER_TOKEN))
    assert tracker.rates().num_observed_steps == window
    assert tracker.rates().step_per_prefill_token_s > PER_TOKEN

    # Once the window holds only steps that agree with calibration, the slow ones have left the fit.
    for prefill_tokens, decodes in [(16, 1), (64, 4), (128, 8), (256, 0)]:
        tracker.observe(sample(prefill_tokens, decodes))
    rates = tracker.rates()
    assert rates.num_observed_steps == window
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)


def test_source_names_calibrated_and_observed_steps():
    tracker = calibrated_tracker(window=3)
    source = tracker.rates().source
    assert "calibrated" in source
    assert str(len(GRID)) in source
    assert "observed" not in source

    for _ in range(5):
        tracker.observe(sample(64, 2))
    source = tracker.rates().source
    assert "calibrated" in source
    assert "observed" in source
    assert "last 3 steps" in source


def test_new_calibration_invalidates_the_cached_rates():
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=8)
    for prefill_tokens, decodes in GRID:
        tracker.add_calibration(sample(prefill_tokens, decodes, base=10 * BASE))
    slow = tracker.rates()
    for prefill_tokens, decodes in GRID * 20:
        tracker.add_calibration(sample(prefill_tokens, decodes))
    fast = tracker.rates()
    assert fast.num_calibration_steps == 21 * len(GRID)
    assert BASE < fast.step_base_s < slow.step_base_s


def test_rates_without_samples_raise():
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=8)
    assert not tracker.calibrated
    with pytest.raises(RuntimeError):
        tracker.rates()
    tracker.add_calibration(sample(64, 0))
    assert tracker.calibrated


def test_inconsistent_data_never_reports_a_negative_cost():
    tracker = RateTracker(reference_prefill_tokens=200, reference_decode_batch=8)
    # More decodes take less time: a plain fit would give a negative per-decode cost.
    for prefill_tokens, decodes, seconds in [(0, 1, 0.010), (0, 8, 0.005), (100, 0, 0.020), (200, 0, 0.030)]:
        tracker.add_calibration(StepSample(prefill_tokens, decodes, seconds))
    rates = tracker.rates()
    assert rates.step_base_s == pytest.approx(0.005)
    assert rates.step_per_prefill_token_s >= 0
    assert rates.step_per_decode_s >= 0
    assert math.isfinite(rates.prefill_tok_s) and rates.prefill_tok_s > 0
    assert math.isfinite(rates.decode_tok_s) and rates.decode_tok_s > 0


def test_a_window_that_turned_over_many_times_fits_exactly_as_its_last_steps_alone():
    window = 8
    rolled = calibrated_tracker(window=window)
    observed = [sample(p, d, per_token=(1 + i % 5) * PER_TOKEN) for i, (p, d) in enumerate(GRID * 40)]
    for step in observed:
        rolled.observe(step)
    fresh = calibrated_tracker(window=window)
    for step in observed[-window:]:
        fresh.observe(step)
    assert rolled.rates() == fresh.rates()


def test_a_window_of_zero_fits_the_calibration_alone():
    tracker = calibrated_tracker(window=0)
    for _ in range(5):
        tracker.observe(sample(128, 4, per_token=10 * PER_TOKEN))
    rates = tracker.rates()
    assert rates.num_observed_steps == 0
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)


SMALL_ROWS, SMALL_BASE, SMALL_PER_ROW = 12, 0.008, 0.0015


def two_path_time(prefill_tokens: int, decodes: int) -> float:
    """A device whose steps of up to SMALL_ROWS rows take another path, priced by a line of their own."""
    rows = prefill_tokens + decodes
    return SMALL_BASE + SMALL_PER_ROW * rows if rows <= SMALL_ROWS else step_time(prefill_tokens, decodes)


def two_path_tracker(**kwargs) -> RateTracker:
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=32, small_step_rows=SMALL_ROWS,
                          **kwargs)
    for prefill_tokens, decodes in [(128, 0), (256, 0), (0, 32), (0, 1), (0, SMALL_ROWS)]:
        tracker.add_calibration(StepSample(prefill_tokens, decodes, two_path_time(prefill_tokens, decodes)))
    return tracker


def test_small_steps_get_a_line_of_their_own_and_the_larger_steps_keep_theirs():
    rates = two_path_tracker().rates()
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)
    assert rates.small_step_rows == SMALL_ROWS
    assert rates.small_step_base_s == pytest.approx(SMALL_BASE, rel=1e-6)
    assert rates.small_step_per_row_s == pytest.approx(SMALL_PER_ROW, rel=1e-6)
    assert rates.decode_tok_s == pytest.approx(32 / step_time(0, 32), rel=1e-6)  # 32 rows: the larger steps' path


def test_observed_small_steps_move_only_the_small_line_and_leave_the_window_from_it():
    tracker = two_path_tracker(window=4)
    for _ in range(4):
        tracker.observe(StepSample(0, 4, 2 * two_path_time(0, 4)))
    slowed = tracker.rates()
    assert slowed.small_step_base_s + 4 * slowed.small_step_per_row_s > two_path_time(0, 4)
    assert_coefficients(slowed, BASE, PER_TOKEN, PER_DECODE)
    for prefill_tokens, decodes in [(0, 2), (0, 8), (64, 4), (0, 24)]:
        tracker.observe(StepSample(prefill_tokens, decodes, two_path_time(prefill_tokens, decodes)))
    rates = tracker.rates()
    assert rates.small_step_base_s == pytest.approx(SMALL_BASE, rel=1e-6)
    assert rates.small_step_per_row_s == pytest.approx(SMALL_PER_ROW, rel=1e-6)
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)


def test_without_a_small_step_measured_every_step_follows_one_model():
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=8, small_step_rows=4)
    for prefill_tokens, decodes in [(64, 0), (256, 0), (0, 8), (16, 8)]:
        tracker.add_calibration(sample(prefill_tokens, decodes))
    rates = tracker.rates()
    assert rates.small_step_rows == 0
    assert_coefficients(rates, BASE, PER_TOKEN, PER_DECODE)


def test_with_every_step_small_the_larger_ones_are_priced_by_the_small_line():
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=8, small_step_rows=64)
    for decodes in (1, 8):
        tracker.add_calibration(StepSample(0, decodes, SMALL_BASE + SMALL_PER_ROW * decodes))
    rates = tracker.rates()
    assert rates.step_base_s == pytest.approx(SMALL_BASE) and rates.step_per_decode_s == pytest.approx(SMALL_PER_ROW)
    assert rates.prefill_tok_s == pytest.approx(256 / (SMALL_BASE + 256 * SMALL_PER_ROW))


def test_small_steps_that_cannot_tell_a_slope_never_report_a_negative_cost():
    tracker = RateTracker(reference_prefill_tokens=256, reference_decode_batch=32, small_step_rows=12)
    for prefill_tokens, decodes, seconds in [(256, 0, 0.05), (0, 32, 0.04), (512, 0, 0.09),
                                             (0, 1, 0.010), (0, 8, 0.008)]:  # 8 rows faster than 1
        tracker.add_calibration(StepSample(prefill_tokens, decodes, seconds))
    rates = tracker.rates()
    assert rates.small_step_base_s == pytest.approx(0.008)
    assert rates.small_step_per_row_s == pytest.approx(((0.010 - 0.008) / 1 + 0) / 2)  # the mean marginal cost
