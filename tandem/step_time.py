"""A step's token budget and predicted wall time, from the limits (``SchedulerConfig``) and the step-time model
(``tandem.engine.rates``) a worker reports: the worker's scheduler and the router's plays of its queue share them."""

from __future__ import annotations


def step_budget(limits, decoding: bool, used: int) -> int:
    """Tokens the next request of a step may compute, ``used`` already taken by those before it: a step computes
    ``max_num_batched_tokens``, but where no running request decodes (``decoding`` false) its first request may
    take up to ``max_prefill_step_tokens`` by itself. ``limits`` carries both under those names."""
    if used == 0 and not decoding:
        return max(limits.max_num_batched_tokens, limits.max_prefill_step_tokens)
    return max(0, limits.max_num_batched_tokens - used)


def step_seconds(model, prefill_tokens: int, decodes: int) -> float:
    """Seconds of one step of ``prefill_tokens`` prefill tokens and ``decodes`` decoding requests. ``model``
    carries the reported coefficients under their ``Rates`` names: ``step_base_s``, ``step_per_prefill_token_s``,
    ``step_per_decode_s``, and for steps of at most ``small_step_rows`` rows (0: none), ``small_step_base_s``
    and ``small_step_per_row_s``."""
    rows = prefill_tokens + decodes
    if rows <= model.small_step_rows:
        return model.small_step_base_s + model.small_step_per_row_s * rows
    return model.step_base_s + model.step_per_prefill_token_s * prefill_tokens + model.step_per_decode_s * decodes
