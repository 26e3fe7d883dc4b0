"""The routing core, shared by every front end and by the simulator: plain Python, no grpc, no torch.

- ``build_view``: the one way to turn a worker's report plus the router's in-flight credit into the
  view a policy scores;
- ``route``: a policy's choice over those views, as a ``RoutingDecision`` record;
- ``Failover``: what follows a failed worker call (route again, or end the request, with which status);
- typed errors carrying a ``Status`` that each front end maps to its own codes once.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router_svc.policy import POLICIES, NoEligibleWorker, QueuedWork, RouteInput, Score, WorkerView
from tandem.decision import RoutingDecision, WorkerScore


class Status(enum.Enum):
    """How a request ended, in the vocabulary of gRPC status codes; each front end maps it once."""

    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid argument"
    DEADLINE_EXCEEDED = "deadline exceeded"
    NOT_FOUND = "not found"
    ALREADY_EXISTS = "already exists"
    PERMISSION_DENIED = "permission denied"
    RESOURCE_EXHAUSTED = "resource exhausted"
    FAILED_PRECONDITION = "failed precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out of range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data loss"
    UNAUTHENTICATED = "unauthenticated"


class RoutingError(Exception):
    """The request ends with ``status``; the message says why."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status


class WorkerCallFailed(Exception):
    """A worker's Generate call ended with an error status."""

    def __init__(self, worker: str, status: Status, details: str):
        super().__init__(f"{status.name}: {details}")
        self.worker = worker
        self.status = status
        self.details = details


# Worker errors after which another worker may well succeed.
RETRYABLE = frozenset({Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED, Status.INTERNAL, Status.UNKNOWN, Status.ABORTED})


@dataclass(frozen=True)
class Credit:
    """A request the router sent to a worker, counted until the worker's reports show it."""

    request_id: str
    prefill_tokens: int
    decode_tokens: int


@dataclass(frozen=True)
class WorkerReport:
    """A worker's own report: every request it holds (with ``request_id``), its limits and its step-time model."""

    name: str
    kind: str
    device: str
    requests: tuple[QueuedWork, ...]
    max_active_requests: int
    max_num_batched_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    step_base_s: float
    step_per_prefill_token_s: float
    step_per_decode_s: float
    block_size: int = 16
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0


def build_view(report: WorkerReport, cached_tokens: int, credits: Iterable[Credit] = (),
               state_source: str = "estimate", cached_evictable_tokens: int = 0) -> WorkerView:
    """The view a policy scores: the report's queue plus each credit the report does not show yet.

    Args:
        report: the worker's latest report.
        cached_tokens: tokens of this prompt in the worker's prefix cache (0 when unknown).
        credits: requests the router dispatched to the worker and has not seen finish.
        state_source: "index" for the latest snapshot with the prompt looked up in the worker's prefix index,
            "estimate" for a report made for this prompt, "snapshot" for the latest one alone.
        cached_evictable_tokens: of ``cached_tokens``, those in blocks no request holds.
    """
    visible = {work.request_id for work in report.requests}
    credited = tuple(QueuedWork(False, c.prefill_tokens, c.decode_tokens, credited=True, request_id=c.request_id)
                     for c in credits if c.request_id not in visible)
    return WorkerView(
        name=report.name, kind=report.kind, cached_tokens=cached_tokens,
        max_active_requests=report.max_active_requests, prefill_tok_s=report.prefill_tok_s,
        decode_tok_s=report.decode_tok_s, step_base_s=report.step_base_s,
        step_per_prefill_token_s=report.step_per_prefill_token_s, step_per_decode_s=report.step_per_decode_s,
        max_num_batched_tokens=report.max_num_batched_tokens, queue=report.requests + credited,
        device=report.device, state_source=state_source, cached_evictable_tokens=cached_evictable_tokens,
        block_size=report.block_size, kv_blocks_total=report.kv_blocks_total, kv_blocks_used=report.kv_blocks_used,
        kv_blocks_cached=report.kv_blocks_cached,
    )


@dataclass(frozen=True)
class WorkerStatus:
    """A worker the router knows, routable or not, and its state in words (``serving``, ``unreachable: ...``)."""

    name: str
    kind: str
    status: str


class Failover:
    """One request's failed worker calls, and the rule for what follows each."""

    def __init__(self):
        self.failures: dict[str, WorkerCallFailed] = {}

    @property
    def failed_workers(self) -> tuple[str, ...]:
        return tuple(self.failures)

    def after_failure(self, failure: WorkerCallFailed, tokens_streamed: int) -> RoutingError | None:
        """None: route the request again, without the failed worker. Otherwise the error that ends it.

        Tokens already streamed cannot be taken back, so a failure after the first token ends the request.
        """
        self.failures[failure.worker] = failure
        if tokens_streamed:
            return RoutingError(Status.UNAVAILABLE,
                                f"worker {failure.worker} failed after streaming {tokens_streamed} tokens "
                                f"({failure}); the output is incomplete")
        if failure.status not in RETRYABLE:
            return RoutingError(failure.status, failure.details)
        return None

    def unroutable(self, reason: str, workers: Sequence[WorkerStatus]) -> RoutingError:
        """The error for a request no worker can take: overloaded if every tried worker said so."""
        states = ", ".join(f"{w.name} ({self.failures.get(w.name) or w.status})" for w in workers)
        overloaded = self.failures and all(f.status is Status.RESOURCE_EXHAUSTED for f in self.failures.values())
        return RoutingError(Status.RESOURCE_EXHAUSTED if overloaded else Status.UNAVAILABLE,
                            f"{reason}; workers: {states}")


def route(policy: str, request: RouteInput, views: Sequence[WorkerView], workers: Sequence[WorkerStatus],
          failover: Failover, length_key: str = "") -> RoutingDecision:
    """Choose a worker among ``views`` by ``policy``; every other worker in ``workers`` is listed as ineligible.

    Raises:
        RoutingError: no worker can take the request.
    """
    try:
        decision = POLICIES[policy](views, request)
    except NoEligibleWorker as exc:
        raise failover.unroutable(str(exc), workers) from None
    by_name = {view.name: view for view in views}
    scores = [_score(by_name[s.worker], s, policy) for s in decision.scores]
    for worker in workers:
        if worker.name not in by_name:
            failure = failover.failures.get(worker.name)
            scores.append(WorkerScore(worker.name, worker.kind, eligible=False,
                                      reason=str(failure) if failure else worker.status))
    return RoutingDecision(policy, decision.chosen, request.prompt_tokens, request.max_new_tokens, tuple(scores),
                           failover.failed_workers, request.expected_output, length_key)


def _score(view: WorkerView, score: Score, policy: str) -> WorkerScore:
    eligible = math.isfinite(score.score)
    return WorkerScore(
        view.name, view.kind, eligible, reason="" if eligible else f"excluded by policy {policy}", device=view.device,
        score_s=score.score if eligible else 0.0, cached_tokens=view.cached_tokens,
        pending_prefill_tokens=view.pending_prefill_tokens, pending_decode_tokens=view.pending_decode_tokens,
        inflight_requests=view.inflight_requests, num_running=view.num_running, num_waiting=view.num_waiting,
        prefill_tokens_per_s=view.prefill_tok_s, decode_tokens_per_s=view.decode_tok_s, prefill_s=score.prefill_s,
        decode_s=score.decode_s, state_source=view.state_source,
    )
