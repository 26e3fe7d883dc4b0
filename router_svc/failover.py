"""What follows a failed worker call: route the request again without that worker, or end it, with which
status."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router_svc.errors import RETRYABLE, RoutingError, Status, WorkerCallFailed


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

        Tokens already streamed cannot be taken back, so a failure after the first token ends the request:
        with the failure's own status where another worker would repeat it (the client's deadline passed, say),
        otherwise as ``UNAVAILABLE``.
        """
        self.failures[failure.worker] = failure
        if tokens_streamed:
            return RoutingError(Status.UNAVAILABLE if failure.status in RETRYABLE else failure.status,
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
