"""Per-request records and the summary statistics every benchmark and the simulator report."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

OK = "OK"


@dataclass(frozen=True)
class RequestRecord:
    """One request's life, in seconds from the run's first submission.

    ``status`` is ``OK`` or the gRPC status code name it ended with.
    """

    req_id: str
    worker: str
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    output_tokens: int
    status: str = OK
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], workers: list[str]) -> dict:
    """Makespan (first submission to last completion), output throughput, latency percentiles and
    requests per worker (every worker named, zero included)."""
    completed = [r for r in records if r.status == OK]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s for r in completed), default=start)
    makespan = end - start
    output_tokens = sum(r.output_tokens for r in completed)
    summary: dict = {
        "num_requests": len(records),
        "outcomes": dict(Counter(r.status for r in records)),
        "makespan_s": makespan,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / makespan if makespan > 0 else 0.0,
    }
    for metric in ("ttft", "tpot", "e2e"):
        values = [v for v in (getattr(r, f"{metric}_s") for r in completed) if v is not None]
        for q in (50, 95, 99):
            summary[f"{metric}_p{q}_s"] = percentile(values, q)
    per_worker = Counter(r.worker for r in completed)
    summary["requests_per_worker"] = {name: per_worker.get(name, 0) for name in workers}
    return summary


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")


def records_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
