"""How a routed request can end badly: typed errors carrying a ``Status`` that each front end maps to its
own codes once."""

from __future__ import annotations

import enum


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
