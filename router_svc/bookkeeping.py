"""What the router records about each request: the decision log, the metrics, the trace events and the learned
output lengths, in one place and off the way to the first token."""

from __future__ import annotations

import json
import logging
import time

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

    def decided(self, request_id: str, decision: RoutingDecision) -> None:
        decision_log.info(json.dumps(decision.log_record(request_id)))
        metrics.record_decision(decision)

    def moved(self, span, request_id: str, move: Move) -> None:
        logger.info("request %s moves from %s to %s before its first token: %s", request_id, move.from_worker,
                    move.to_worker, move.reason)
        decision_log.info(json.dumps({"event": "move", "request_id": request_id, "from": move.from_worker,
                                      "to": move.to_worker, "cause": move.cause, "reason": move.reason,
                                      "from_s": move.from_s, "to_s": move.to_s}))
        span.add_event("tandem.routing.moved", {"tandem.routing.moved_from": move.from_worker,
                                                "tandem.routing.moved_to": move.to_worker,
                                                "tandem.routing.move_cause": move.cause,
                                                "tandem.routing.move_reason": move.reason})
        metrics.ROUTING_MOVES.labels(move.from_worker, move.to_worker, move.cause).inc()

    def failed_over(self, worker: str, failure: Exception) -> None:
        logger.warning("worker %s failed before the first token (%s); failing over", worker, failure)
        metrics.ROUTING_FAILOVERS.labels(worker).inc()

    def streamed(self, request, span, response: worker_pb2.GenerateResponse, started: float, first: bool) -> None:
        """One response of the worker's stream; ``first``: no token was streamed before it."""
        if first and response.token_ids:
            metrics.TTFT.labels(request.frontend).observe(time.monotonic() - started)
        if response.HasField("result"):
            result = response.result
            span.set_attributes({
                "gen_ai.usage.output_tokens": result.usage.output_tokens,
                "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(result.finish_reason)
                                                   .removeprefix("FINISH_REASON_").lower()],
            })
            metrics.E2E.labels(request.frontend).observe(time.monotonic() - started)
            self.output_lengths.observe(request.length_key, result.usage.output_tokens, request.max_new_tokens)
