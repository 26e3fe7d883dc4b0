"""Sampling settings, validated where a request enters: by the router's front ends and by every engine."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.errors import InvalidRequestError
from tandem.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_SAMPLES = 16  # samples of one prompt in one request (``n``)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy.

    The logits are processed in this order: ``allowed_token_ids``, ``logit_bias``, the ban on ending before ``min_tokens``, the
    repetition, frequency and presence penalties, then ``temperature``, ``min_p``, ``top_k`` and ``top_p``.
    Log-probabilities are those of the model's own distribution, before any of these.

    Args:
        temperature: softmax temperature, >= 0.
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        min_p: drop tokens less likely than ``min_p`` times the most likely one; 0 keeps every token.
        seed: makes sampling reproducible for this request when set, whatever else runs beside it.
        presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
        repetition_penalty: divides the positive logits (multiplies the negative ones) of every token in the
            prompt or the output; > 0, and 1 leaves them as they are.
        min_tokens: the end-of-sequence token, the stop token ids and the stop strings cannot end the request
            before it has generated this many tokens.
        logit_bias: added to the logit of each token id, each in [-100, 100].
        allowed_token_ids: when not empty, only these token ids can be sampled.
        logprobs: return each generated token's log-probability and this many of the most likely
            alternatives (0 to ``MAX_LOGPROBS``); None returns none.
        prompt_logprobs: the same for every prompt token after the first; None returns none.
        structured_output: the language the output must match (checked when it is made); None: any.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2 <= value <= 2):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidRequestError("logit_bias", f"keys must be token ids >= 0, got {token!r}")
            if not _is_number(bias) or not (-100 <= bias <= 100):
                raise InvalidRequestError(f"logit_bias.{token}", f"must be in [-100, 100], got {bias!r}")
        if any(not _is_int(token) or token < 0 for token in self.allowed_token_ids):
            raise InvalidRequestError("allowed_token_ids", "must be token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def check_samples(n: object, field: str = "n") -> int:
    """``n``, the samples a request asks of its prompt, once checked: 1 to ``MAX_SAMPLES``."""
    if not _is_int(n) or not 1 <= n <= MAX_SAMPLES:
        raise InvalidRequestError(field, f"must be an integer from 1 to {MAX_SAMPLES}, got {n!r}")
    return n


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
