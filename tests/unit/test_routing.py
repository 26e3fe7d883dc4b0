"""Unit tests for the routing core (router_svc/routing.py) and the decision record (tandem/decision.py)."""

from __future__ import annotations

import json

import pytest

from router_svc.errors import RoutingError, Status, WorkerCallFailed
from router_svc.failover import Failover, WorkerStatus
from router_svc.policies import RouteInput, route
from router_svc.worker_view import Credit, QueuedWork, WorkerReport, WorkerView
from tandem.decision import SCORE_PARTS, RoutingDecision
from tandem.protocol import decision_from_message, decision_message


def report(name: str, kind: str = "gpu", requests: tuple[QueuedWork, ...] = (), prefill: float = 1000.0,
           decode: float = 100.0) -> WorkerReport:
    return WorkerReport(name=name, kind=kind, device=f"{kind}:0", requests=requests, max_active_requests=4,
                        max_num_batched_tokens=256, prefill_tok_s=prefill, decode_tok_s=decode, step_base_s=0.01,
                        step_per_prefill_token_s=0.001, step_per_decode_s=0.002)


RUNNING = QueuedWork(True, 0, 30, request_id="r1")
WAITING = QueuedWork(False, 40, 64, request_id="r2")


# --- WorkerView.of ----------------------------------------------------------------------------------

def test_view_totals_come_from_the_reported_queue():
    view = WorkerView.of(report("g", requests=(RUNNING, WAITING)), cached_tokens=96)
    assert (view.num_running, view.num_waiting, view.inflight_requests) == (1, 1, 0)
    assert (view.pending_prefill_tokens, view.pending_decode_tokens) == (40, 94)
    assert view.cached_tokens == 96 and view.state_source == "estimate" and view.report.device == "gpu:0"
    assert view.score_parts()["device"] == "gpu:0" and view.score_parts()["decode_tokens_per_s"] == 100.0


def test_credit_joins_the_queue_as_waiting_work_until_the_report_shows_it():
    credits = [Credit("r2", 999, 999), Credit("r3", 20, 128)]  # r2 is already in the report: not counted twice
    view = WorkerView.of(report("g", requests=(RUNNING, WAITING)), 0, credits, state_source="snapshot")
    assert (view.num_running, view.num_waiting, view.inflight_requests) == (1, 2, 1)
    assert (view.pending_prefill_tokens, view.pending_decode_tokens) == (60, 222)
    assert view.queue[-1] == QueuedWork(False, 20, 128, credited=True, request_id="r3")
    assert view.state_source == "snapshot"


def test_a_view_cannot_disagree_with_itself():
    view = WorkerView.of(report("g"), 0, [Credit("a", 5, 7)])
    assert view.num_running + view.num_waiting == len(view.queue) == 1
    assert view.pending_decode_tokens == sum(work.decode_tokens for work in view.queue) == 7


# --- route ---------------------------------------------------------------------------------------------

WORKERS = [WorkerStatus("cpu", "cpu", "serving"), WorkerStatus("gpu", "gpu", "serving"),
           WorkerStatus("down", "gpu", "unreachable: UNAVAILABLE")]


def views(**busy_gpu):
    return [WorkerView.of(report("cpu", "cpu", prefill=73.0, decode=45.0), 496),
            WorkerView.of(report("gpu", requests=busy_gpu.get("requests", ()), prefill=2551.0, decode=293.0), 496)]


def test_route_chooses_the_lowest_score_and_lists_every_known_worker():
    decision = route("cost", RouteInput(516, 128), views(), WORKERS, Failover())
    assert decision.chosen_worker == "gpu" and decision.policy == "cost"
    assert [s.worker for s in decision.scores] == ["gpu", "cpu", "down"]
    gpu, cpu, down = decision.scores
    assert gpu.eligible and gpu.score_s == pytest.approx(20 / 2551 + 128 / 293)
    assert (gpu.prefill_s, gpu.decode_s) == (pytest.approx(20 / 2551), pytest.approx(128 / 293))
    assert cpu.eligible and cpu.score_s > gpu.score_s and cpu.prefill_tokens_per_s == 73.0
    assert not down.eligible and down.reason == "unreachable: UNAVAILABLE" and down.score_s == 0
    assert (decision.prompt_tokens, decision.max_new_tokens, decision.failed_workers) == (516, 128, ())


def test_a_worker_the_policy_excludes_is_listed_with_its_state_and_the_reason():
    decision = route("gpu_only", RouteInput(516, 128), views(), WORKERS, Failover())
    cpu = next(s for s in decision.scores if s.worker == "cpu")
    assert not cpu.eligible and cpu.reason == "excluded by policy gpu_only" and cpu.score_s == 0
    assert cpu.cached_tokens == 496 and cpu.decode_tokens_per_s == 45.0


def test_route_reports_the_busy_workers_queue_with_credit():
    busy = views(requests=tuple(QueuedWork(True, 0, 124) for _ in range(4)))
    credited = [busy[0], WorkerView.of(report("gpu", prefill=2551.0, decode=293.0), 496, [Credit("x", 20, 128)])]
    decision = route("cost", RouteInput(516, 128), credited, WORKERS, Failover())
    gpu = next(s for s in decision.scores if s.worker == "gpu")
    assert (gpu.inflight_requests, gpu.num_waiting, gpu.pending_decode_tokens) == (1, 1, 128)
    assert route("cost", RouteInput(516, 128), busy, WORKERS, Failover()).chosen.num_running == 4


# --- failover ------------------------------------------------------------------------------------------

def test_a_retryable_failure_before_the_first_token_routes_again_without_that_worker():
    failover = Failover()
    assert failover.after_failure(WorkerCallFailed("gpu", Status.UNAVAILABLE, "connection reset"), 0) is None
    decision = route("cost", RouteInput(516, 128), views()[:1], WORKERS, failover)
    assert decision.chosen_worker == "cpu" and decision.failed_workers == ("gpu",)
    gpu = next(s for s in decision.scores if s.worker == "gpu")
    assert not gpu.eligible and gpu.reason == "UNAVAILABLE: connection reset"


@pytest.mark.parametrize("status", sorted(Status, key=lambda s: s.name), ids=lambda s: s.name)
def test_only_errors_another_worker_may_not_repeat_are_retried(status):
    error = Failover().after_failure(WorkerCallFailed("gpu", status, "details"), 0)
    retryable = status in {Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED, Status.INTERNAL, Status.UNKNOWN,
                           Status.ABORTED}
    assert (error is None) == retryable
    if not retryable:
        assert error.status is status and str(error) == "details"


def test_a_failure_after_the_first_token_ends_the_request_as_incomplete():
    error = Failover().after_failure(WorkerCallFailed("gpu", Status.UNAVAILABLE, "worker died"), 5)
    assert error.status is Status.UNAVAILABLE
    assert str(error) == ("worker gpu failed after streaming 5 tokens (UNAVAILABLE: worker died); "
                          "the output is incomplete")


def test_a_deadline_that_passes_after_the_first_token_keeps_its_status():
    error = Failover().after_failure(WorkerCallFailed("gpu", Status.DEADLINE_EXCEEDED, "Deadline Exceeded"), 2)
    assert error.status is Status.DEADLINE_EXCEEDED
    assert str(error).startswith("worker gpu failed after streaming 2 tokens")


def test_every_worker_overloaded_ends_as_resource_exhausted():
    failover = Failover()
    for name in ("cpu", "gpu"):
        assert failover.after_failure(WorkerCallFailed(name, Status.RESOURCE_EXHAUSTED, "queue full"), 0) is None
    with pytest.raises(RoutingError) as info:
        route("cost", RouteInput(516, 128), [], WORKERS, failover)
    assert info.value.status is Status.RESOURCE_EXHAUSTED
    assert str(info.value) == ("no healthy worker; workers: cpu (RESOURCE_EXHAUSTED: queue full), "
                               "gpu (RESOURCE_EXHAUSTED: queue full), down (unreachable: UNAVAILABLE)")


def test_failures_of_mixed_kinds_end_as_unavailable():
    failover = Failover()
    failover.after_failure(WorkerCallFailed("cpu", Status.RESOURCE_EXHAUSTED, "queue full"), 0)
    failover.after_failure(WorkerCallFailed("gpu", Status.INTERNAL, "bug"), 0)
    with pytest.raises(RoutingError) as info:
        route("cost", RouteInput(516, 128), [], WORKERS, failover)
    assert info.value.status is Status.UNAVAILABLE


def test_no_healthy_worker_is_unavailable_naming_each_workers_state():
    with pytest.raises(RoutingError) as info:
        route("cost", RouteInput(10, 4), [], WORKERS, Failover())
    assert info.value.status is Status.UNAVAILABLE
    assert str(info.value) == ("no healthy worker; workers: cpu (serving), gpu (serving), "
                               "down (unreachable: UNAVAILABLE)")


def test_a_policy_that_finds_no_eligible_worker_is_unavailable():
    with pytest.raises(RoutingError) as info:
        route("gpu_only", RouteInput(10, 4), views()[:1], WORKERS, Failover())
    assert info.value.status is Status.UNAVAILABLE and str(info.value).startswith("policy gpu_only found no")


# --- the decision record and what is made from it ---------------------------------------------------------

def decision() -> RoutingDecision:
    failover = Failover()
    failover.after_failure(WorkerCallFailed("down", Status.UNAVAILABLE, "gone"), 0)
    return route("cost", RouteInput(516, 128), views(), WORKERS, failover)


def test_the_wire_message_carries_every_part_and_reads_back_equal():
    record = decision()
    message = decision_message(record)
    assert [s.worker for s in message.scores] == ["gpu", "cpu", "down"]
    assert message.scores[0].kind != message.scores[1].kind and list(message.failed_workers) == ["down"]
    assert_same_decision(decision_from_message(message), record)


def assert_same_decision(read: RoutingDecision, record: RoutingDecision) -> None:
    assert (read.policy, read.chosen_worker, read.prompt_tokens, read.max_new_tokens, read.failed_workers) == (
        record.policy, record.chosen_worker, record.prompt_tokens, record.max_new_tokens, record.failed_workers)
    for a, b in zip(read.scores, record.scores, strict=True):
        for part in ("worker", "kind", "eligible", "reason", "device", *SCORE_PARTS):
            assert getattr(a, part) == getattr(b, part), part


def test_the_log_record_is_json_with_every_part_of_every_score():
    entry = json.loads(json.dumps(decision().log_record("req-1")))
    assert entry["event"] == "route" and entry["request_id"] == "req-1" and entry["chosen"] == "gpu"
    assert entry["failed_workers"] == ["down"]
    assert all(set(SCORE_PARTS) <= set(score) for score in entry["scores"])
    assert entry["scores"][2]["reason"] == "UNAVAILABLE: gone"


def test_span_attributes_name_the_choice_and_each_eligible_workers_parts():
    attributes = decision().span_attributes()
    assert attributes["tandem.routing.chosen_worker"] == "gpu" and attributes["tandem.routing.cached_tokens"] == 496
    assert attributes["tandem.routing.failed_workers"] == ["down"]
    for part in SCORE_PARTS:
        assert f"tandem.routing.worker.gpu.{part}" in attributes
    assert attributes["tandem.routing.worker.down.eligible"] is False
    assert attributes["tandem.routing.worker.down.reason"] == "UNAVAILABLE: gone"
    assert "tandem.routing.worker.down.score_s" not in attributes


def test_the_table_marks_the_choice_and_explains_ineligible_workers():
    lines = decision().table().splitlines()
    assert lines[0] == "policy cost: 516 prompt tokens, 128 new (128 expected) -> gpu (after failures: down)"
    assert lines[1].split() == ["worker", "score", "s", "cached", "prefill", "decode", "inflight", "prefill/s",
                                "decode/s", "source"]
    assert lines[2].startswith("* gpu") and lines[2].split()[3] == "496" and lines[2].endswith("estimate")
    assert lines[3].startswith("  cpu")
    assert lines[4] == "  down        not eligible: UNAVAILABLE: gone"


def test_every_score_part_is_a_field_of_the_wire_message():
    from tandem.v1 import router_pb2

    assert set(SCORE_PARTS) <= set(router_pb2.WorkerScore.DESCRIPTOR.fields_by_name)
