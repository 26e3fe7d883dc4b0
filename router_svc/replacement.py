"""Re-placing a request that waits on a worker before its first token, when its estimate there went stale.

A decision is made on what the workers report at arrival. While a request waits in a worker's queue, that
can change: the work ahead of it evicts the cached prefix it was sent there for, or another worker frees
up. Its predicted finish where it waits (``queued_finish_time``) is then compared with the finish the other
workers predict for it as a new arrival (``finish_time_score``): it moves when one of them is clearly
earlier. Only requests routed by ``finish_time`` move, only while the worker reports them waiting (no
token produced, none streamed), and at most ``MAX_MOVES`` times; the margin (``MOVE_MARGIN`` of the
current estimate, and at least ``MIN_MOVE_GAIN_S``) is the hysteresis that keeps a request from moving
back and forth between two workers whose estimates are close.

The check runs for all waiting requests at once, every ``CHECK_INTERVAL_S``: each worker's next waiting
requests (as many as it runs at once, in its queue order) are the candidates, every worker is asked once
for its state and its cache's hold on the candidates' prompts, and the candidates are considered in turn
(``plan_moves``), each seeing the moves decided before it, so that one worker freeing up does not draw
every waiting request at once. ``Replacer`` runs that round in the router, over the workers' latest
snapshots and their prefix indexes, asking no worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router_svc.output_lengths import OutputLengths
from router_svc.policies import RouteInput, finish_time_score, queued_finish_time
from router_svc.worker_view import Credit, WorkerReport, WorkerView

if TYPE_CHECKING:
    from router_svc.request_path import RoutedRequest
    from router_svc.workers import WorkerRegistry

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Waiting:
    """A request routed by ``finish_time`` to ``worker``, with no token yet: a candidate for a move.

    ``placed_s`` is its finish estimate there when it was placed, at ``placed_at`` (the same clock as the
    ``now`` of ``plan_moves``); ``excluded`` are the workers it may not go to (failed it, or left by a move).
    """

    request_id: str
    request: RouteInput
    worker: str
    placed_s: float
    placed_at: float
    moves: int = 0
    excluded: frozenset[str] = frozenset()


def candidates(waiting: Mapping[str, Waiting], reports: Mapping[str, WorkerReport]) -> list[Waiting]:
    """The waiting requests a round considers: on each worker, those among its next ``max_active_requests``
    waiting requests in its queue order (the ones it would start next)."""
    chosen = []
    for report in reports.values():
        queued = [work.request_id for work in report.requests if not work.running][:report.max_active_requests]
        chosen += [waiting[rid] for rid in queued if rid in waiting and waiting[rid].worker == report.name]
    return chosen


def plan_moves(round_candidates: Sequence[Waiting], reports: Mapping[str, WorkerReport],
               credits: Mapping[str, Sequence[Credit]], cached: Mapping[tuple[str, str], tuple[int, int]],
               now: float) -> list[tuple[Waiting, Move]]:
    """One round of the check over the workers' reports: the moves to make, in order.

    Args:
        round_candidates: in the order they are considered (``candidates``).
        reports: each worker's report, as fresh as the round's answers.
        credits: each worker's requests the router sent it that its report may not show yet.
        cached: (request id, worker) -> (cached tokens, of those evictable) of the request's prompt on that
            worker; a worker without an entry is not a destination for that request.
        now: the clock of ``Waiting.placed_at``.
    """
    added: dict[str, list[Credit]] = defaultdict(list)  # the requests this round has moved to each worker

    def view(name: str, cached_tokens: int = 0, evictable: int = 0) -> WorkerView:
        return WorkerView.of(reports[name], cached_tokens, [*credits.get(name, ()), *added[name]], "index", evictable)

    moves = []
    for entry in round_candidates:
        if entry.worker not in reports:
            continue
        others = [view(name, *cached[entry.request_id, name]) for name in reports
                  if name != entry.worker and name not in entry.excluded and (entry.request_id, name) in cached]
        move = consider_move(entry.request_id, entry.request, view(entry.worker), others,
                             entry.placed_s - (now - entry.placed_at), entry.moves)
        if move is not None:
            moves.append((entry, move))
            uncached = entry.request.prompt_tokens - cached[entry.request_id, move.to_worker][0]
            added[move.to_worker].append(Credit(entry.request_id, max(0, uncached), entry.request.max_new_tokens,
                                                entry.request.constrained))
    return moves


@dataclass
class _Entry:
    request: RoutedRequest
    worker: str
    placed_s: float
    placed_at: float
    moves: int
    excluded: frozenset[str]
    moved: asyncio.Future

    def waiting(self, lengths: OutputLengths) -> Waiting:
        """The request as a candidate now, priced with the output lengths learned so far."""
        return Waiting(self.request.request_id, self.request.route_input(lengths), self.worker, self.placed_s,
                       self.placed_at, self.moves, self.excluded)


class Replacer:
    """Watches the requests waiting on their workers and hands each the move the check decides for it."""

    def __init__(self, registry: WorkerRegistry, interval_s: float, output_lengths: OutputLengths):
        self.registry = registry
        self.interval_s = interval_s
        self.output_lengths = output_lengths
        self._entries: dict[str, _Entry] = {}
        self._task: asyncio.Task | None = None

    async def first_response_or_move(self, call, request: RoutedRequest, worker: str, placed_s: float,
                                     placed_at: float, moves: int, excluded: frozenset[str]):
        """Waits for the call's first response while the request, placed on ``worker`` with a finish estimate
        of ``placed_s`` at ``placed_at``, is a candidate for moves (``Waiting``). Returns ([the first
        response], None), ([], None) when the call ended without one, or ([], the move) with the call still
        unanswered."""
        moved = asyncio.get_running_loop().create_future()
        self._entries[request.request_id] = _Entry(request, worker, placed_s, placed_at, moves, excluded, moved)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="replacement-check")
        first = asyncio.ensure_future(_next_response(call))
        try:
            await asyncio.wait({first, moved}, return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                response = first.result()
                return ([] if response is None else [response]), None
            return [], moved.result()
        finally:
            self._entries.pop(request.request_id, None)
            first.cancel()
            moved.cancel()

    async def _run(self) -> None:
        while self._entries:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:
                logger.exception("re-placement check failed; trying again in %.2f s", self.interval_s)

    def check(self) -> None:
        """One round: the candidates by the workers' latest reports, their prompts looked up in the prefix
        indexes of the workers they may move to, the moves."""
        entries = {rid: entry.waiting(self.output_lengths) for rid, entry in self._entries.items()}
        backends = self.registry.healthy()
        reports = {b.name: b.report(b.state) for b in backends}
        considered = candidates(entries, reports)
        if not considered:
            return
        cached = {(entry.request_id, b.name): b.prefix_index.cached(self._entries[entry.request_id].request.prompt_blocks,
                                                                    reports[b.name].block_size)
                  for b in backends if b.prefix_index.synced
                  for entry in considered if entry.worker != b.name and b.name not in entry.excluded}
        credits = {b.name: list(b.credits.values()) for b in backends}
        for entry, move in plan_moves(considered, reports, credits, cached, time.monotonic()):
            waiting = self._entries.get(entry.request_id)
            if waiting is not None and not waiting.moved.done():
                waiting.moved.set_result(move)


async def _next_response(call):
    """The call's next response, None at its end."""
    try:
        return await call.__anext__()
    except StopAsyncIteration:
        return None
