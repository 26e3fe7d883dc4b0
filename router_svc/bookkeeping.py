"""What the router records about each request: the decision log, the metrics, the trace events and the learned
output lengths, in one place and off the way to the first token."""

from __future__ import annotations

import json
import logging

from router_svc import metrics
from router_svc.output_lengths import OutputLengths
from router_svc.replacement import Move
from tandem.decision import RoutingDecision
from tandem.v1 import common_pb2, worker_pb2

logger = logging.getLogger(__name__)
decision_log = logging.getLogger("tandem.router.decisions")


class Bookkeeping:
    def __init__(self, output_lengths: OutputLengths):
        self.output_lengths = output_lengths

    def attempt(self, request, decision: RoutingDecision, span, started: float) -> "AttemptRecord":
        """The record of one try of ``request`` on the worker ``decision`` chose; ``started``: when the
        request arrived (``time.monotonic()``)."""
        return AttemptRecord(self.output_lengths, request, decision, span, started)


class AttemptRecord:
    """What is recorded about one try on one worker. Each response is recorded once it has been passed on,
    and the decision is logged when the try ends (with its stream, a move or a failure): on a machine whose
    cores the workers and clients share, the log line's cost then delays no token of any request."""

    def __init__(self, output_lengths: OutputLengths, request, decision: RoutingDecision, span, started: float):
        self.output_lengths = output_lengths
        self.request = request
        self.decision = decision
        self.span = span
        self.started = started
        self.streamed_tokens = 0
        self._decision_logged = False

    def streamed(self, response: worker_pb2.GenerateResponse, received: float) -> None:
        """A response of the worker's stream, received at ``received`` and passed on since."""
        request = self.request
        if response.token_ids and not self.streamed_tokens:
            metrics.TTFT.labels(request.frontend).observe(received - self.started)
        self.streamed_tokens += len(response.token_ids)
        if response.HasField("result"):
            result = response.result
            self.span.set_attributes({
                "gen_ai.usage.output_tokens": result.usage.output_tokens,
                "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(result.finish_reason)
                                                   .removeprefix("FINISH_REASON_").lower()],
            })
            metrics.E2E.labels(request.frontend).observe(received - self.started)
            self.output_lengths.observe(request.length_key, result.usage.output_tokens, request.max_new_tokens)

    def moved(self, move: Move) -> None:
        self._log_decision()
        request_id = self.request.request_id
        logger.info("request %s moves from %s to %s before its first token: %s", request_id, move.from_worker,
                    move.to_worker, move.reason)
        decision_log.info(json.dumps({"event": "move", "request_id": request_id, "from": move.from_worker,
                                      "to": move.to_worker, "cause": move.cause, "reason": move.reason,
                                      "from_s": move.from_s, "to_s": move.to_s}))
        self.span.add_event("tandem.routing.moved", {"tandem.routing.moved_from": move.from_worker,
                                                     "tandem.routing.moved_to": move.to_worker,
                                                     "tandem.routing.move_cause": move.cause,
                                                     "tandem.routing.move_reason": move.reason})
        metrics.ROUTING_MOVES.labels(move.from_worker, move.to_worker, move.cause).inc()

    def failed_over(self, failure: Exception) -> None:
        self._log_decision()
        worker = self.decision.chosen_worker
        logger.warning("worker %s failed before the first token (%s); failing over", worker, failure)
        metrics.ROUTING_FAILOVERS.labels(worker).inc()

    def ended(self) -> None:
        self._log_decision()

    def _log_decision(self) -> None:
        if not self._decision_logged:
            self._decision_logged = True
            decision_log.info(json.dumps(self.decision.log_record(self.request.request_id)))
            metrics.record_decision(self.decision)
