"""The router's request path, shared by every front end, as named stages:

admission -> decide -> attempt on one worker (credit, call, first token or move, proxy, release) -> after a
failure or a move before the first token, decide again.

It speaks in routing-core terms (``RoutingDecision``, ``RoutingError``); a front end prepares its requests
(``router_svc.frontends.preparation``) and converts the events out. What is recorded about a request is
``router_svc.bookkeeping``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router_svc import metrics
from router_svc.admission import Admission
from router_svc.bookkeeping import Bookkeeping
from router_svc.errors import RoutingError, Status, WorkerCallFailed
from router_svc.failover import Failover, WorkerStatus
from router_svc.output_lengths import OutputLengths
from router_svc.policies import RouteInput, route
from router_svc.prefix_index import PromptBlocks
from router_svc.replacement import CHECK_INTERVAL_S, MAX_MOVES, Move, Replacer
from router_svc.worker_view import WorkerView
from router_svc.workers import WorkerRegistry, probe_all
from tandem.decision import RoutingDecision
from tandem.telemetry import child_span, mark_failed, mark_failed_status, tracer
from tandem.v1 import common_pb2, worker_pb2

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

    @property
    def constrained(self) -> bool:
        """It has a structured output, whose mask each of its steps pays."""
        return self.worker_request.sampling.HasField("structured_output")

    @property
    def samples(self) -> int:
        """Samples of the prompt the request asks for (``n``), all generated on the chosen worker."""
        return self.worker_request.n or 1

    @functools.cached_property
    def prompt_blocks(self) -> PromptBlocks:
        return PromptBlocks(self.prompt_token_ids)

    def route_input(self, lengths: OutputLengths, sequence: int = 0) -> RouteInput:
        """The request as the policies price it now: its expected output as learned so far."""
        return RouteInput(self.prompt_tokens, self.max_new_tokens, sequence,
                          lengths.expected_tokens(self.length_key, self.max_new_tokens), lengths.fraction(),
                          self.samples, self.constrained)


@dataclass(frozen=True)
class WorkerOutput:
    """One response of the chosen worker's stream."""

    worker: str
    response: worker_pb2.GenerateResponse


class Tries:
    """One request's attempts so far: the workers that failed it, the moves it made, and whether it is done."""

    def __init__(self):
        self.failover = Failover()
        self.moves: list[Move] = []
        self.finished = False

    @property
    def excluded(self) -> frozenset[str]:
        """Workers the request is not routed to again: those that failed it and those it moved away from."""
        return frozenset(self.failover.failures) | {move.from_worker for move in self.moves}


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
        self.output_lengths = OutputLengths(on_update=metrics.set_output_fraction)
        self.bookkeeping = Bookkeeping(self.output_lengths)
        self.replacer = Replacer(registry, replace_interval_s, self.output_lengths) if replace_interval_s else None
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
            tries = Tries()
            while not tries.finished:
                decision = await self.decide(request, span, tries)
                async for event in self._attempt(request, decision, tries, span, started):
                    yield event
        finally:
            self.admission.release()

    async def decide(self, request: RoutedRequest, parent_span, tries: Tries | None = None) -> RoutingDecision:
        """Probe every healthy worker not yet failed or left by a move, and route by the request's policy.

        Raises:
            RoutingError: no worker can take the request.
        """
        tries = tries or Tries()
        route_span = child_span(_tracer, parent_span, "route", attributes={"tandem.routing.policy": request.policy})
        try:
            views = await self._views(request, tries.excluded)
            decision = route(request.policy, request.route_input(self.output_lengths, self._sequence), views,
                             self._workers(), tries.failover, request.length_key)
            if tries.moves:
                decision = dataclasses.replace(decision, moved_from=tuple(m.from_worker for m in tries.moves),
                                               move_reason=tries.moves[-1].reason)
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

    async def _attempt(self, request: RoutedRequest, decision: RoutingDecision, tries: Tries, span,
                       started: float) -> AsyncIterator[RoutingDecision | WorkerOutput]:
        """One try on the chosen worker: credit, call, the decision out, first token or move, proxy, release.
        Marks ``tries`` finished once the stream ended; returns unfinished after a move or a failover."""
        worker = self.registry.workers.get(decision.chosen_worker)
        if worker is None:  # it left the pool while the decision was made
            tries.failover.after_failure(WorkerCallFailed(decision.chosen_worker, Status.UNAVAILABLE, "left the pool"), 0)
            return
        self._sequence += 1
        worker.dispatch(request.request_id, request.prompt_blocks,
                        max(0, request.prompt_tokens - decision.chosen.cached_tokens),
                        request.max_new_tokens * request.samples, request.constrained)
        call = worker.generate(request.worker_request, _remaining(request.deadline), span)
        placed_at = time.monotonic()
        record = self.bookkeeping.attempt(request, decision, span, started)
        try:
            yield decision  # the worker call is under way while the decision goes out
            first, move = await self._first_response_or_move(request, decision, tries, call, placed_at)
            if move is not None:
                tries.moves.append(move)
                record.moved(move)
                return
            async for response in _chained(first, call, request.samples):
                received = time.monotonic()
                yield WorkerOutput(worker.name, response)
                record.streamed(response, received)
            tries.finished = True
        except WorkerCallFailed as failure:
            worker.failed_requests += 1
            error = tries.failover.after_failure(failure, record.streamed_tokens)
            if error is not None:
                raise error from None
            record.failed_over(failure)
        finally:
            record.ended()
            call.close()  # a withdrawn request is cancelled on its worker, which frees its blocks
            worker.release(request.request_id)

    async def _first_response_or_move(self, request: RoutedRequest, decision: RoutingDecision, tries: Tries, call,
                                      placed_at: float):
        """([the first response] or [], None), or ([], a move) for a request the re-placement check moves first."""
        if request.policy != "finish_time" or self.replacer is None or len(tries.moves) >= MAX_MOVES \
                or request.samples > 1:  # the worker queues its samples under ids of their own
            return [], None
        return await self.replacer.first_response_or_move(call, request, decision.chosen_worker,
                                                          decision.chosen.score_s, placed_at, len(tries.moves),
                                                          tries.excluded)

    async def _views(self, request: RoutedRequest, excluded: frozenset[str]) -> list[WorkerView]:
        """A view of every healthy worker not in ``excluded``: the prompt looked up in the worker's prefix
        index, or, while that index is not synced, a probe of the worker for this prompt."""
        candidates = [w for w in self.registry.healthy() if w.name not in excluded]
        unsynced = [w for w in candidates if not w.prefix_index.synced]
        estimates = dict(zip(unsynced, await probe_all(unsynced, request.prompt_token_ids, self.probe_deadline_s)))
        views = []
        for worker in candidates:
            if worker not in estimates:
                views.append(worker.indexed_view(request.prompt_blocks))
            elif estimates[worker] is None or estimates[worker].serving_state == common_pb2.SERVING_STATE_SERVING:
                views.append(worker.view(estimates[worker]))
        return views

    def _workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w.name, w.kind, w.describe()) for w in self.registry.workers.values()]


async def _chained(first: list, call, samples: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
    for response in first:
        yield response
    if first and first[-1].HasField("result") and samples == 1:
        return
    async for response in call:
        yield response


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
