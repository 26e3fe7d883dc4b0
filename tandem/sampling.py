"""Sampling settings, validated where a request enters: by the router's front ends and by every engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy.

    Args:
        temperature: softmax temperature, >= 0.
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        seed: makes sampling reproducible for this request when set.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
