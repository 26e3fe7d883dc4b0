"""Prefill and decode rates from a step-time model fitted to measured steps.

A step's wall time is modelled as ``base + per_prefill_token * prefill_tokens + per_decode * decodes``.
Where the device runs steps of few rows another way (a CPU's decode copy of the weights, up to
``small_step_rows`` rows of decodes and prefill tokens together), those steps have a line of their own,
``small_base + small_per_row * rows``, fitted to them alone (``tandem.step_time``).
Calibration steps at start-up seed the fit and always stay in it; the most recent observed steps
join it, so the rates follow the device as load and thermals change.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.step_time import step_seconds

_RIDGE = 1e-9


@dataclass(frozen=True)
class StepSample:
    num_prefill_tokens: int
    num_decode_requests: int
    seconds: float

    @property
    def rows(self) -> int:
        return self.num_prefill_tokens + self.num_decode_requests


@dataclass(frozen=True)
class Rates:
    """Throughputs derived from the fitted step-time model.

    ``prefill_tok_s`` is the rate of a full prefill chunk (``reference_prefill_tokens``) alone;
    ``decode_tok_s`` is the aggregate rate of a full decode batch (``reference_decode_batch``).
    """

    prefill_tok_s: float
    decode_tok_s: float
    step_base_s: float
    step_per_prefill_token_s: float
    step_per_decode_s: float
    reference_prefill_tokens: int
    reference_decode_batch: int
    num_calibration_steps: int
    num_observed_steps: int
    step_per_constrained_row_s: float = 0.0  # a structured output's mask, per row that has one
    small_step_rows: int = 0  # steps of at most this many rows follow the small-step line; 0: none do
    small_step_base_s: float = 0.0
    small_step_per_row_s: float = 0.0

    @property
    def source(self) -> str:
        if self.num_observed_steps == 0:
            return f"calibrated ({self.num_calibration_steps} start-up steps)"
        return (
            f"calibrated ({self.num_calibration_steps} start-up steps) "
            f"+ observed (last {self.num_observed_steps} steps)"
        )


class RateTracker:
    """Least-squares fit of step times over calibration samples plus a window of observed steps.

    Args:
        reference_prefill_tokens: chunk size at which ``prefill_tok_s`` is quoted.
        reference_decode_batch: batch size at which ``decode_tok_s`` is quoted.
        window: how many recent observed steps take part in the fit.
        small_step_rows: steps of at most this many rows get a line of their own; 0: none do.
    """

    def __init__(self, reference_prefill_tokens: int, reference_decode_batch: int, window: int = 256,
                 small_step_rows: int = 0):
        self.reference_prefill_tokens = reference_prefill_tokens
        self.reference_decode_batch = reference_decode_batch
        self.small_step_rows = small_step_rows
        self._calibration: list[StepSample] = []
        self._observed: deque[StepSample] = deque(maxlen=window)
        # over the calibration samples and the observed window: the larger steps, and the small ones
        self._sums = _NormalEquations()
        self._small_sums = _SmallStepSums()
        self._rates: Rates | None = None

    def calibration_steps(self) -> list[tuple[int, int]]:
        """The steps, as (prefill tokens, decodes), that calibrate the model: half and full prefill chunks, a
        decode step of one request and of a full batch, and the largest small step where it is neither."""
        chunk, batch = self.reference_prefill_tokens, self.reference_decode_batch
        steps = [(max(1, chunk // 2), 0), (chunk, 0), (0, batch), (0, 1)]
        if 1 < self.small_step_rows < batch:
            steps.append((0, self.small_step_rows))
        return steps

    def _add(self, sample: StepSample, sign: int = 1) -> None:
        if sample.rows <= self.small_step_rows:
            self._small_sums.add(sample, sign)
        else:
            self._sums.add(sample, sign)

    def add_calibration(self, sample: StepSample) -> None:
        self._calibration.append(sample)
        self._add(sample)
        self._rates = None

    def observe(self, sample: StepSample) -> None:
        if self._observed.maxlen == 0:  # a fit of the calibration alone
            return
        if len(self._observed) == self._observed.maxlen:
            self._add(self._observed[0], -1)
        self._observed.append(sample)
        self._add(sample)
        self._rates = None

    @property
    def calibrated(self) -> bool:
        return bool(self._calibration)

    def rates(self) -> Rates:
        if self._rates is None:
            self._rates = self._fit()
        return self._rates

    def _fit(self) -> Rates:
        if not self._calibration and not self._observed:
            raise RuntimeError("no step has been measured yet")
        large, small = self._sums.xtx[0][0], self._small_sums.count  # how many steps each fit holds
        base, per_token, per_decode = self._least_squares() if large else (0.0, 0.0, 0.0)
        small_base, small_per_row = self._small_sums.line(lambda: self._samples(small=True)) if small else (0.0, 0.0)
        if not large:  # every step measured was small: the larger ones are priced as small ones
            base, per_token, per_decode = small_base, small_per_row, small_per_row
        rates = Rates(
            prefill_tok_s=0.0,
            decode_tok_s=0.0,
            step_base_s=base,
            step_per_prefill_token_s=per_token,
            step_per_decode_s=per_decode,
            reference_prefill_tokens=self.reference_prefill_tokens,
            reference_decode_batch=self.reference_decode_batch,
            num_calibration_steps=len(self._calibration),
            num_observed_steps=len(self._observed),
            small_step_rows=self.small_step_rows if small else 0,
            small_step_base_s=small_base,
            small_step_per_row_s=small_per_row,
        )
        return dataclasses.replace(
            rates,
            prefill_tok_s=self.reference_prefill_tokens / step_seconds(rates, self.reference_prefill_tokens, 0),
            decode_tok_s=self.reference_decode_batch / step_seconds(rates, 0, self.reference_decode_batch))

    def _samples(self, small: bool) -> list[StepSample]:
        """The steps in the fit of the small steps, or of the larger ones."""
        return [s for s in (*self._calibration, *self._observed) if (s.rows <= self.small_step_rows) == small]

    def _least_squares(self) -> tuple[float, float, float]:
        """Ridge least squares for the three step-time coefficients of the larger steps."""
        xtx = [[float(value) for value in row] for row in self._sums.xtx]
        xty = [value * 1e-9 for value in self._sums.xty_ns]
        for i in range(3):
            xtx[i][i] += _RIDGE * (1.0 + xtx[i][i])
        coefficients = _solve(xtx, xty)
        # A coefficient fitted below zero means the data cannot tell it apart; fall back to the
        # simplest consistent model rather than report a negative cost.
        if min(coefficients) < 0:
            samples = self._samples(small=False)
            base = min(s.seconds for s in samples)
            per_token = _mean_marginal(samples, base, lambda s: s.num_prefill_tokens)
            per_decode = _mean_marginal(samples, base, lambda s: s.num_decode_requests)
            return base, per_token, per_decode
        return coefficients[0], coefficients[1], coefficients[2]


class _NormalEquations:
    """XᵀX and Xᵀy of the step-time regression, kept as running sums so that a well-posed refit costs
    the same however many steps it spans. Step times enter in whole nanoseconds: every sum is an exact
    integer, and removing a sample that leaves the window undoes its addition exactly."""

    def __init__(self):
        self.xtx = [[0] * 3 for _ in range(3)]
        self.xty_ns = [0] * 3

    def add(self, sample: StepSample, sign: int = 1) -> None:
        row = (1, sample.num_prefill_tokens, sample.num_decode_requests)
        nanoseconds = sign * round(sample.seconds * 1e9)
        for i in range(3):
            self.xty_ns[i] += row[i] * nanoseconds
            for j in range(3):
                self.xtx[i][j] += sign * row[i] * row[j]


class _SmallStepSums:
    """The running sums of the small steps' line, seconds against rows, kept exact as ``_NormalEquations``."""

    def __init__(self):
        self.count = self.rows = self.rows_squared = self.seconds_ns = self.rows_seconds_ns = 0

    def add(self, sample: StepSample, sign: int = 1) -> None:
        nanoseconds = round(sample.seconds * 1e9)
        self.count += sign
        self.rows += sign * sample.rows
        self.rows_squared += sign * sample.rows ** 2
        self.seconds_ns += sign * nanoseconds
        self.rows_seconds_ns += sign * sample.rows * nanoseconds

    def line(self, samples: Callable[[], list[StepSample]]) -> tuple[float, float]:
        """(base, per row) of the least-squares line; where the steps cannot tell the slope or it falls below
        zero, the fastest of ``samples()`` and the mean marginal cost above it."""
        spread = self.count * self.rows_squared - self.rows ** 2
        if spread > 0:
            per_row = (self.count * self.rows_seconds_ns - self.rows * self.seconds_ns) / spread * 1e-9
            base = (self.seconds_ns * 1e-9 - per_row * self.rows) / self.count
            if per_row >= 0 and base >= 0:
                return base, per_row
        steps = samples()
        base = min(s.seconds for s in steps)
        return base, _mean_marginal(steps, base, lambda s: s.rows)


def _mean_marginal(samples: list[StepSample], base: float, units) -> float:
    values = [(s.seconds - base) / units(s) for s in samples if units(s) > 0]
    return max(0.0, sum(values) / len(values)) if values else 0.0


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small dense system."""
    n = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0:
            raise ZeroDivisionError("singular step-time system")
        for row in range(col + 1, n):
            factor = a[row][col] / a[col][col]
            for k in range(col, n + 1):
                a[row][k] -= factor * a[col][k]
    result = [0.0] * n
    for row in range(n - 1, -1, -1):
        result[row] = (a[row][n] - sum(a[row][k] * result[k] for k in range(row + 1, n))) / a[row][row]
    return result
