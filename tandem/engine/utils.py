"""Small arithmetic shared by the engine, the simulator and the benchmarks."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for integers with ``b > 0``."""
    return -(-a // b)
