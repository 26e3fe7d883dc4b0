"""A step's predicted wall time, from the step-time model a worker reports (``tandem.engine.rates``)."""

from __future__ import annotations


def step_seconds(model, prefill_tokens: int, decodes: int) -> float:
    """Seconds of one step of ``prefill_tokens`` prefill tokens and ``decodes`` decoding requests. ``model``
    carries the reported coefficients under their ``Rates`` names: ``step_base_s``, ``step_per_prefill_token_s``,
    ``step_per_decode_s``, and for steps of at most ``small_step_rows`` rows (0: none), ``small_step_base_s``
    and ``small_step_per_row_s``."""
    rows = prefill_tokens + decodes
    if rows <= model.small_step_rows:
        return model.small_step_base_s + model.small_step_per_row_s * rows
    return model.step_base_s + model.step_per_prefill_token_s * prefill_tokens + model.step_per_decode_s * decodes
