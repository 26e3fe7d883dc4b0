"""The re-placement rule (router_svc/replacement.py): when a waiting request moves, and when it stays."""

from __future__ import annotations

import pytest

from router_svc.policy import QueuedWork, RouteInput, finish_time_score
from router_svc.replacement import EARLIER_ELSEWHERE, ESTIMATE_GREW, MAX_MOVES, consider_move
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
