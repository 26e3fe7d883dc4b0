"""The router's request path, shared by every front end: admit, probe, route, proxy the worker's stream,
fail over. It speaks in routing-core terms (``RoutingDecision``, ``RoutingError``); a front end only
converts its requests in and its events out."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router_svc import metrics
from router_svc.admission import Admission
from router_svc.errors import RoutingError, Status, WorkerCallFailed
from router_svc.failover import Failover, WorkerStatus
from router_svc.output_lengths import OutputLengths
from router_svc.policies import RouteInput, route
from router_svc.prefix_index import PromptBlocks
from router_svc.replacement import CHECK_INTERVAL_S, MAX_MOVES, Move, Waiting
from router_svc.replacer import Replacer
from router_svc.worker_view import WorkerView
from router_svc.workers import WorkerRegistry, probe_all
from tandem.decision import RoutingDecision
from tandem.telemetry import child_span, mark_failed, mark_failed_status, tracer
from tandem.v1 import common_pb2, worker_pb2

logger = logging.getLogger(__name__)
decision_log = logging.getLogger("tandem.router.decisions")
_tracer = tracer("tandem.router")


@dataclass(frozen=True)
class RoutedRequest:
    """A validated, tokenized request, ready to route.

    ``worker_request`` is the message the chosen worker receives; ``deadline`` is a ``time.monotonic()``
    instant, or None for none; ``frontend`` labels the request's metrics; ``length_key`` groups requests
    whose output lengths are learned together.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    policy: str
    worker_request: worker_pb2.GenerateRequest
    deadline: float | None = None
    frontend: str = "grpc"
    length_key: str = ""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def prompt_blocks(self) -> PromptBlocks:
        return PromptBlocks(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkerOutput:
    """One response of the chosen worker's stream."""

    worker: str
    response: worker_pb2.GenerateResponse


class Router:
    """Routes requests over the registry's workers, each whole request to the worker its policy picks.

    ``replace_interval_s``: how often the requests routed by ``finish_time`` and still waiting on their
    workers are checked for a move (``router_svc.replacement``); 0 never moves one.
    """

    def __init__(self, registry: WorkerRegistry, admission: Admission, probe_deadline_s: float,
                 replace_interval_s: float = CHECK_INTERVAL_S):
        self.registry = registry
        self.admission = admission
        self.probe_deadline_s = probe_deadline_s
        self.replacer = Replacer(registry, replace_interval_s) if replace_interval_s else None
        self.output_lengths = OutputLengths(on_update=metrics.set_output_fraction)
        self._sequence = 0

    async def generate(self, request: RoutedRequest, span) -> AsyncIterator[RoutingDecision | WorkerOutput]:
        """The decision, then the worker's responses; after a failure, or a move, before the first token, a
        new decision and the next worker's responses.

        Raises:
            RoutingError: the request was refused or could not be completed; its status says how.
        """
        started = time.monotonic()
        await self.admission.acquire()
        try:
            failover = Failover()
            moves: list[Move] = []
            while True:
                decision = await self.decide(request, span, failover, moves)
                backend = self.registry.workers.get(decision.chosen_worker)
                if backend is None:  # it left the pool while the decision was made
                    failover.after_failure(WorkerCallFailed(decision.chosen_worker, Status.UNAVAILABLE, "left the pool"), 0)
                    continue
                self._sequence += 1
                backend.dispatch(request.request_id, max(0, request.prompt_tokens - decision.chosen.cached_tokens),
                                 request.max_new_tokens)
                call = backend.generate(request.worker_request, _remaining(request.deadline), span)
                placed_at = time.monotonic()
                streamed, move = 0, None
                try:
                    try:  # the worker call is already under way while the decision goes out
                        yield decision
                    finally:  # bookkeeping, kept off the way to the first token
                        decision_log.info(json.dumps(decision.log_record(request.request_id)))
                        metrics.record_decision(decision)
                    first: list[worker_pb2.GenerateResponse] = []
                    if request.policy == "finish_time" and self.replacer is not None and len(moves) < MAX_MOVES:
                        waiting = Waiting(request.request_id, self._route_input(request), decision.chosen_worker,
                                          decision.chosen.score_s, placed_at, len(moves),
                                          frozenset(_excluded(failover, moves)))
                        first, move = await self.replacer.first_response_or_move(
                            call, waiting, request.prompt_blocks, lambda: self._route_input(request))
                    if move is None:
                        async for response in _chained(first, call):
                            if response.token_ids and not streamed:
                                metrics.TTFT.labels(request.frontend).observe(time.monotonic() - started)
                            streamed += len(response.token_ids)
                            if response.HasField("result"):
                                _record_result(span, response.result)
                                metrics.E2E.labels(request.frontend).observe(time.monotonic() - started)
                                self.output_lengths.observe(request.length_key, response.result.usage.output_tokens,
                                                            request.max_new_tokens)
                            yield WorkerOutput(backend.name, response)
                        return
                except WorkerCallFailed as failure:
                    error = failover.after_failure(failure, streamed)
                finally:
                    call.close()  # a withdrawn request is cancelled on its worker, which frees its blocks
                    backend.release(request.request_id)
                if move is not None:
                    moves.append(move)
                    _record_move(span, request.request_id, move)
                    continue
                backend.failed_requests += 1
                if error is not None:
                    raise error
                logger.warning("worker %s failed before the first token (%s); failing over", backend.name,
                               failover.failures[backend.name])
                metrics.ROUTING_FAILOVERS.labels(backend.name).inc()
        finally:
            self.admission.release()

    async def decide(self, request: RoutedRequest, parent_span, failover: Failover | None = None,
                     moves: list[Move] | tuple[Move, ...] = ()) -> RoutingDecision:
        """Probe every healthy worker not yet failed or left by a move, and route by the request's policy.

        Raises:
            RoutingError: no worker can take the request.
        """
        failover = failover or Failover()
        route_span = child_span(_tracer, parent_span, "route", attributes={"tandem.routing.policy": request.policy})
        try:
            views = await self._views(request, _excluded(failover, moves))
            decision = route(request.policy, self._route_input(request), views, self._workers(), failover,
                             request.length_key)
            if moves:
                decision = dataclasses.replace(decision, moved_from=tuple(m.from_worker for m in moves),
                                               move_reason=moves[-1].reason)
        except RoutingError as exc:
            mark_failed_status(route_span, exc.status.name, str(exc))
            raise
        except BaseException as exc:
            mark_failed(route_span, exc)
            raise
        else:
            if route_span.is_recording():
                route_span.set_attributes(decision.span_attributes())
            return decision
        finally:
            route_span.end()

    async def _views(self, request: RoutedRequest, excluded: set[str]) -> list[WorkerView]:
        """A view of every healthy worker not in ``excluded``: the prompt looked up in the worker's prefix
        index, or, while that index is not synced, a probe of the worker for this prompt."""
        candidates = [b for b in self.registry.healthy() if b.name not in excluded]
        unsynced = [b for b in candidates if not b.prefix_index.synced]
        estimates = dict(zip(unsynced, await probe_all(unsynced, request.prompt_token_ids, self.probe_deadline_s)))
        views = []
        for backend in candidates:
            if backend not in estimates:
                views.append(backend.indexed_view(request.prompt_blocks))
            elif estimates[backend] is None or estimates[backend].serving_state == common_pb2.SERVING_STATE_SERVING:
                views.append(backend.view(estimates[backend]))
        return views

    def _route_input(self, request: RoutedRequest) -> RouteInput:
        lengths = self.output_lengths
        return RouteInput(request.prompt_tokens, request.max_new_tokens, self._sequence,
                          lengths.expected_tokens(request.length_key, request.max_new_tokens), lengths.fraction())

    def _workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(b.name, b.kind, b.describe()) for b in self.registry.workers.values()]


def _excluded(failover: Failover, moves) -> set[str]:
    """Workers a request is not routed to again: those that failed it and those it moved away from."""
    return set(failover.failures) | {move.from_worker for move in moves}


async def _chained(first: list, call) -> AsyncIterator[worker_pb2.GenerateResponse]:
    for response in first:
        yield response
    if first and first[-1].HasField("result"):
        return
    async for response in call:
        yield response


def _record_move(span, request_id: str, move: Move) -> None:
    """Log, trace and count a move."""
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


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _record_result(span, result: worker_pb2.GenerateResult) -> None:
    span.set_attributes({
        "gen_ai.usage.output_tokens": result.usage.output_tokens,
        "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(result.finish_reason)
                                           .removeprefix("FINISH_REASON_").lower()],
    })
