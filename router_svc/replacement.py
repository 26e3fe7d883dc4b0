"""Re-placing a request that waits on a worker before its first token, when its estimate there went stale.

A decision is made on what the workers report at arrival. While a request waits in a worker's queue, that
can change: the work ahead of it evicts the cached prefix it was sent there for, or another worker frees
up. Its predicted finish where it waits (``queued_finish_time``) is then compared with the finish the other
workers predict for it as a new arrival (``finish_time_score``): it moves when one of them is clearly
earlier. Only requests routed by ``finish_time`` move, only while the worker reports them waiting (no
token produced, none streamed), and at most ``MAX_MOVES`` times; the margin (``MOVE_MARGIN`` of the
current estimate, and at least ``MIN_MOVE_GAIN_S``) is the hysteresis that keeps a request from moving
back and forth between two workers whose estimates are close.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router_svc.policy import RouteInput, WorkerView, finish_time_score, queued_finish_time

MAX_MOVES = 2
MOVE_MARGIN = 0.2
MIN_MOVE_GAIN_S = 0.25
CHECK_INTERVAL_S = 1.0  # how often a waiting request's placement is checked
ESTIMATE_GREW = "estimate_grew"
EARLIER_ELSEWHERE = "earlier_elsewhere"


@dataclass(frozen=True)
class Move:
    """Withdraw the request from ``from_worker`` and route it again: ``to_worker`` predicts ``to_s`` seconds
    to finish against ``from_s`` where it waits. ``cause`` is ESTIMATE_GREW (its estimate where it waits
    grew past the margin since it was placed, as when its cached prefix was evicted) or EARLIER_ELSEWHERE."""

    from_worker: str
    to_worker: str
    cause: str
    from_s: float
    to_s: float
    placed_s: float  # the estimate where it waits, as made when it was placed, less the time since

    @property
    def reason(self) -> str:
        if self.cause == ESTIMATE_GREW:
            return (f"its estimate on {self.from_worker} grew from {self.placed_s:.2f} s to {self.from_s:.2f} s; "
                    f"{self.to_worker} predicts {self.to_s:.2f} s")
        return f"{self.to_worker} predicts {self.to_s:.2f} s against {self.from_s:.2f} s on {self.from_worker}"


def consider_move(request_id: str, request: RouteInput, current: WorkerView, others: Sequence[WorkerView],
                  placed_s: float, moves: int) -> Move | None:
    """The move to make for ``request_id``, waiting on ``current``, or None to leave it there.

    Args:
        request: the request as it was routed (expected output included).
        others: the other workers it may move to.
        placed_s: its finish estimate on ``current`` when it was placed, less the seconds since.
        moves: how many times it has moved already.
    """
    if moves >= MAX_MOVES or not others:
        return None
    entry = next((work for work in current.queue if work.request_id == request_id), None)
    if entry is None or entry.running:
        return None
    here = queued_finish_time(current, request_id, request)
    best = min((finish_time_score(view, request) for view in others), key=lambda score: score.score)
    if best.score > here * (1 - MOVE_MARGIN) or here - best.score < MIN_MOVE_GAIN_S:
        return None
    cause = ESTIMATE_GREW if here > placed_s * (1 + MOVE_MARGIN) else EARLIER_ELSEWHERE
    return Move(current.name, best.worker, cause, here, best.score, placed_s)
