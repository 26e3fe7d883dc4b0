"""How much of ``max_new_tokens`` requests really use, learned from finished requests.

A request's budget is only an upper bound: chat replies stop at end-of-sequence long before it. Pricing
the budget sends work away from a worker that would have finished it first. The router learns, per
client-supplied key (``length_key``) and over all requests, the fraction of the budget used, as an
exponential moving average shrunk towards 1 (the whole budget) while it has few samples:

    fraction = (n · ema + PRIOR_SAMPLES) / (n + PRIOR_SAMPLES)

so a new key starts at the budget and moves to what it is seen to use. A key without samples of its own
borrows the overall figure. The budget stays the bound for KV reservation on the worker.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from tandem.errors import InvalidRequestError

OVERALL = ""  # the key of the figure over all requests
EMA_WEIGHT = 0.05  # each new sample's weight: about the last 20 requests count
PRIOR_SAMPLES = 4.0
MAX_KEYS = 1024  # the least recently used key beyond these is forgotten
MAX_KEY_LENGTH = 128


def check_length_key(field: str, key: str) -> None:
    """Raises InvalidRequestError naming ``field`` unless ``key`` is a usable length key."""
    if len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise InvalidRequestError(field, f"must be at most {MAX_KEY_LENGTH} printable characters, got {key[:40]!r}"
                                         f"{'…' if len(key) > 40 else ''}")


@dataclass
class LearnedLength:
    """One key's figure: the shrunk fraction of the budget used, and how many requests taught it."""

    key: str
    fraction: float
    samples: int


class _Average:
    def __init__(self) -> None:
        self.ema = 1.0
        self.samples = 0

    def add(self, fraction: float) -> None:
        self.ema = fraction if self.samples == 0 else self.ema + EMA_WEIGHT * (fraction - self.ema)
        self.samples += 1

    @property
    def fraction(self) -> float:
        return (self.samples * self.ema + PRIOR_SAMPLES) / (self.samples + PRIOR_SAMPLES)


class OutputLengths:
    """The router's learned output lengths (single-threaded: the router's event loop, or the simulator)."""

    def __init__(self, max_keys: int = MAX_KEYS, on_update=None):
        """``on_update(key, fraction, samples)`` is called after each observation, and with fraction None
        when a key is forgotten."""
        self._overall = _Average()
        self._keys: OrderedDict[str, _Average] = OrderedDict()
        self._max_keys = max_keys
        self._on_update = on_update

    def observe(self, key: str, output_tokens: int, max_new_tokens: int) -> None:
        """A finished request: it generated ``output_tokens`` of its ``max_new_tokens``."""
        if max_new_tokens <= 0:
            return
        used = min(1.0, max(0, output_tokens) / max_new_tokens)
        self._update(OVERALL, self._overall, used)
        if key:
            average = self._keys.pop(key, None) or _Average()
            self._keys[key] = average
            self._update(key, average, used)
            if len(self._keys) > self._max_keys:
                forgotten, _ = self._keys.popitem(last=False)
                if self._on_update:
                    self._on_update(forgotten, None, 0)

    def fraction(self, key: str = OVERALL) -> float:
        """The share of its budget a request with ``key`` is expected to use."""
        average = self._keys.get(key) if key else None
        return (average if average is not None else self._overall).fraction

    def expected_tokens(self, key: str, max_new_tokens: int) -> int:
        """Tokens a request with ``key`` and this budget is expected to generate (at least 1)."""
        return max(1, min(max_new_tokens, math.ceil(max_new_tokens * self.fraction(key))))

    def learned(self) -> list[LearnedLength]:
        """The overall figure first, then every remembered key, most recently used last."""
        return [LearnedLength(OVERALL, self._overall.fraction, self._overall.samples),
                *(LearnedLength(key, a.fraction, a.samples) for key, a in self._keys.items())]

    def _update(self, key: str, average: _Average, used: float) -> None:
        average.add(used)
        if self._on_update:
            self._on_update(key, average.fraction, average.samples)
