"""The re-placement rule (router_svc/replacement.py): when a waiting request moves, and when it stays; which
waiting requests a round considers, and how each sees the moves decided before it."""

from __future__ import annotations

import pytest

from router_svc.policies import RouteInput, finish_time_score
from router_svc.replacement import (
    EARLIER_ELSEWHERE,
    ESTIMATE_GREW,
    MAX_MOVES,
    Waiting,
    candidates,
    consider_move,
    plan_moves,
)
from router_svc.worker_view import QueuedWork, WorkerReport
from tests.unit.test_policy import make_view

STEPS = dict(step_base_s=0.01, step_per_prefill_token_s=1e-4, step_per_decode_s=1e-4, max_num_batched_tokens=64,
             max_active_requests=1)
REQUEST = RouteInput(prompt_tokens=32, max_new_tokens=8)


def waiting_behind(remaining_decodes: int, running: bool = False) -> object:
    """A worker with one slot, busy for ``remaining_decodes`` steps, and our request queued behind it."""
    queue = (QueuedWork(True, 0, remaining_decodes), QueuedWork(running, 32, 8, request_id="ours"))
    return make_view("busy", queue=queue, **STEPS)


def test_a_waiting_request_moves_to_a_worker_that_finishes_it_clearly_earlier():
    idle = make_view("idle", **STEPS)
    current = waiting_behind(500)
    move = consider_move("ours", REQUEST, current, [idle], placed_s=5.5, moves=0)
    assert (move.from_worker, move.to_worker, move.cause) == ("busy", "idle", EARLIER_ELSEWHERE)
    assert move.to_s == pytest.approx(finish_time_score(idle, REQUEST).score) and move.from_s > 5
    grown = consider_move("ours", REQUEST, current, [idle], placed_s=1.0, moves=0)
    assert grown.cause == ESTIMATE_GREW and "grew from 1.00 s" in grown.reason


def test_it_stays_without_a_clear_margin_once_running_and_after_its_moves():
    current = waiting_behind(10)  # about 0.11 s ahead of it: no other worker can be 0.25 s earlier
    assert consider_move("ours", REQUEST, current, [make_view("idle", **STEPS)], placed_s=1.0, moves=0) is None
    close = make_view("close", queue=(QueuedWork(True, 0, 450),), **STEPS)  # less than 20% earlier
    assert consider_move("ours", REQUEST, waiting_behind(500), [close], placed_s=6.0, moves=0) is None
    idle = make_view("idle", **STEPS)
    assert consider_move("ours", REQUEST, waiting_behind(500, running=True), [idle], 6.0, moves=0) is None
    assert consider_move("ours", REQUEST, waiting_behind(500), [idle], 6.0, moves=MAX_MOVES) is None
    assert consider_move("gone", REQUEST, waiting_behind(500), [idle], 6.0, moves=0) is None


def report(name: str, requests: tuple[QueuedWork, ...], max_active: int, step_base_s: float = 0.01) -> WorkerReport:
    return WorkerReport(name=name, kind="cpu", device="cpu", requests=requests, max_active_requests=max_active,
                        max_num_batched_tokens=64, prefill_tok_s=1000.0, decode_tok_s=100.0, step_base_s=step_base_s,
                        step_per_prefill_token_s=1e-4, step_per_decode_s=1e-4)


def waiting(request_id: str, worker: str = "busy", **fields) -> Waiting:
    return Waiting(request_id, REQUEST, worker, placed_s=1.0, placed_at=0.0, **fields)


def test_a_round_considers_each_workers_next_waiting_requests_in_its_queue_order():
    queue = (QueuedWork(True, 0, 100, request_id="run"),
             *(QueuedWork(False, 32, 8, request_id=f"w{i}") for i in range(4)))
    reports = {"busy": report("busy", queue, max_active=3), "idle": report("idle", (), max_active=1)}
    entries = {rid: waiting(rid) for rid in ("w3", "w2", "w0", "run")}
    entries["w1"] = waiting("w1", worker="idle")  # the worker it was sent to does not show it (not yet, or no more)
    assert [entry.request_id for entry in candidates(entries, reports)] == ["w0", "w2"]  # w3 is fourth in line


def test_each_move_of_a_round_is_seen_by_the_requests_considered_after_it():
    running = tuple(QueuedWork(True, 0, 100, request_id=f"run{i}") for i in range(3))
    queue = running + tuple(QueuedWork(False, 32, 8, request_id=f"w{i}") for i in range(3))
    reports = {"busy": report("busy", queue, max_active=3), "slow": report("slow", (), max_active=1, step_base_s=0.1)}
    entries = {f"w{i}": waiting(f"w{i}") for i in range(3)}
    cached = {(f"w{i}", "slow"): (0, 0) for i in range(3)}
    considered = candidates(entries, reports)
    moves = plan_moves(considered, reports, {}, cached, now=0.0)
    assert [(entry.request_id, move.to_worker) for entry, move in moves] == [("w0", "slow")]
    alone = plan_moves([entries["w1"]], reports, {}, cached, now=0.0)  # without w0 moved ahead of it, w1 would go
    assert [(entry.request_id, move.to_worker) for entry, move in alone] == [("w1", "slow")]


def test_a_round_moves_a_request_only_to_a_worker_it_may_go_to_and_that_answered():
    queue = (QueuedWork(True, 0, 500), QueuedWork(False, 32, 8, request_id="ours"))
    reports = {"busy": report("busy", queue, max_active=1), "idle": report("idle", (), max_active=1),
               "other": report("other", (), max_active=1)}
    entry = waiting("ours", excluded=frozenset({"idle"}))
    assert [move.to_worker for _, move in plan_moves([entry], reports, {}, {("ours", "idle"): (0, 0)}, 0.0)] == []
    cached = {("ours", "idle"): (0, 0), ("ours", "other"): (0, 0)}
    assert [move.to_worker for _, move in plan_moves([entry], reports, {}, cached, 0.0)] == ["other"]
    assert plan_moves([waiting("ours", moves=MAX_MOVES)], reports, {}, cached, 0.0) == []
