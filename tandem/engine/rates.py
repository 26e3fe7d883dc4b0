"""Prefill and decode rates from a step-time model fitted to measured steps.

A step's wall time is modelled as ``base + per_prefill_token * prefill_tokens + per_decode * decodes``.
Calibration steps at start-up seed the fit and always stay in it; the most recent observed steps
join it, so the rates follow the device as load and thermals change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_RIDGE = 1e-9


@dataclass(frozen=True)
class StepSample:
    num_prefill_tokens: int
    num_decode_requests: int
    seconds: float


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
    """

    def __init__(self, reference_prefill_tokens: int, reference_decode_batch: int, window: int = 256):
        self.reference_prefill_tokens = reference_prefill_tokens
        self.reference_decode_batch = reference_decode_batch
        self._calibration: list[StepSample] = []
        self._observed: deque[StepSample] = deque(maxlen=window)
        self._sums = _NormalEquations()  # over the calibration samples and the observed window
        self._rates: Rates | None = None

    def add_calibration(self, sample: StepSample) -> None:
        self._calibration.append(sample)
        self._sums.add(sample)
        self._rates = None

    def observe(self, sample: StepSample) -> None:
        if self._observed.maxlen == 0:  # a fit of the calibration alone
            return
        if len(self._observed) == self._observed.maxlen:
            self._sums.add(self._observed[0], -1)
        self._observed.append(sample)
        self._sums.add(sample)
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
        base, per_token, per_decode = self._least_squares()
        prefill_time = base + per_token * self.reference_prefill_tokens
        decode_time = base + per_decode * self.reference_decode_batch
        return Rates(
            prefill_tok_s=self.reference_prefill_tokens / prefill_time,
            decode_tok_s=self.reference_decode_batch / decode_time,
            step_base_s=base,
            step_per_prefill_token_s=per_token,
            step_per_decode_s=per_decode,
            reference_prefill_tokens=self.reference_prefill_tokens,
            reference_decode_batch=self.reference_decode_batch,
            num_calibration_steps=len(self._calibration),
            num_observed_steps=len(self._observed),
        )

    def _least_squares(self) -> tuple[float, float, float]:
        """Ridge least squares for the three step-time coefficients."""
        xtx = [[float(value) for value in row] for row in self._sums.xtx]
        xty = [value * 1e-9 for value in self._sums.xty_ns]
        for i in range(3):
            xtx[i][i] += _RIDGE * (1.0 + xtx[i][i])
        coefficients = _solve(xtx, xty)
        # A coefficient fitted below zero means the data cannot tell it apart; fall back to the
        # simplest consistent model rather than report a negative cost.
        if min(coefficients) < 0:
            samples = self._calibration + list(self._observed)
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
