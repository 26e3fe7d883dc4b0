"""Errors raised at the API of an engine or the router; each gRPC or HTTP edge maps each to one status code."""


class InvalidRequestError(ValueError):
    """A request field is invalid. ``field`` names it, as the API spells it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class ContextLengthExceeded(InvalidRequestError):
    """The prompt, or the prompt and its output budget, do not fit the model's context."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the request was not accepted."""


class EngineDeadError(RuntimeError):
    """The engine stopped after a fault and accepts no more work."""
