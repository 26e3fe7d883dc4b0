"""The simulation loop: arrivals are routed by a real policy over views built from real schedulers, and
each worker's steps take the time its step model says.

What is simulated: step times (from the model) and the transport (the router sees each worker's state
at the instant a request arrives, and dispatch is instant). What is real: the policy code, the
scheduler (admission, chunked prefill, token budget, KV blocks, prefix cache, preemption).
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from dataclasses import dataclass, field

from router_svc.output_lengths import OutputLengths
from router_svc.policies import POLICIES, NoEligibleWorker, Ranking, RouteInput
from router_svc.replacement import CHECK_INTERVAL_S, Move, Waiting, candidates, plan_moves
from router_svc.worker_view import QueuedWork, WorkerReport, WorkerView
from simulator.profiles import WorkerProfile
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.utils import cdiv
from tandem.errors import QueueFullError
from tandem.loadgen.results import OK, RequestRecord, summarize
from tandem.loadgen.workloads import Workload, WorkloadRequest
from tandem.step_time import step_budget

_TOKEN_SPACE = 1 << 20


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimWorker:
    """A worker: the engine's scheduler driven by a step-time model instead of a model."""

    def __init__(self, name: str, profile: WorkerProfile, clock: VirtualClock):
        self.name = name
        self.profile = profile
        self.clock = clock
        self.scheduler = Scheduler(profile.scheduler, profile.num_kv_blocks, clock=clock)
        self.rates = profile.step.fitted_rates(profile.scheduler)
        self.step_output: SchedulerOutput | None = None
        self.step_end = 0.0
        self.output_targets: dict[str, int] = {}
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_preemptions = 0
        self.max_running = 0

    def view(self, prompt_token_ids: tuple[int, ...]) -> WorkerView:
        cached = self.scheduler.cached_prefix(prompt_token_ids)
        return WorkerView.of(self.report(), cached.tokens, cached_evictable_tokens=cached.evictable_tokens)

    def report(self) -> WorkerReport:
        rates, pool = self.rates, self.scheduler.pool
        return WorkerReport(
            name=self.name, kind=self.profile.kind, device=f"sim-{self.profile.kind}",
            requests=tuple(QueuedWork(r.running, r.prefill_tokens, r.decode_budget, request_id=r.req_id,
                                      cached_tokens=r.cached_tokens)
                           for r in self.scheduler.load().requests),
            max_active_requests=self.profile.scheduler.max_active_requests,
            max_num_batched_tokens=self.profile.scheduler.max_num_batched_tokens,
            max_prefill_step_tokens=step_budget(self.profile.scheduler, decoding=False, used=0),
            prefill_tok_s=rates.prefill_tok_s, decode_tok_s=rates.decode_tok_s, step_base_s=rates.step_base_s,
            step_per_prefill_token_s=rates.step_per_prefill_token_s, step_per_decode_s=rates.step_per_decode_s,
            small_step_rows=rates.small_step_rows, small_step_base_s=rates.small_step_base_s,
            small_step_per_row_s=rates.small_step_per_row_s,
            block_size=pool.block_size, kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_free_blocks,
        )

    def fits(self, request: WorkloadRequest) -> bool:
        """The engine's admission check: prompt plus budget must fit the KV cache at all."""
        blocks = cdiv(len(request.prompt_token_ids) + request.max_new_tokens, self.profile.scheduler.block_size)
        return blocks <= self.profile.num_kv_blocks

    def add(self, request: WorkloadRequest) -> Request:
        """Queue a request (QueueFullError when the waiting queue is full)."""
        engine_request = Request(request.req_id, list(request.prompt_token_ids), request.max_new_tokens,
                                 ignore_eos=True, arrival_time=self.clock.now)
        self.scheduler.add_request(engine_request)
        self.output_targets[request.req_id] = request.output_tokens
        return engine_request

    @property
    def busy(self) -> bool:
        return self.step_output is not None

    def start_step(self) -> bool:
        """Schedule a step now; False when there is nothing to run."""
        if not self.scheduler.has_work():
            return False
        output = self.scheduler.schedule()
        self.num_preemptions += len(output.preempted)
        self.max_running = max(self.max_running, len(self.scheduler.running))
        if not output.scheduled:
            return False
        seconds = self.profile.step.seconds(output.num_prefill_tokens, output.num_decode_requests)
        self.step_output, self.step_end = output, self.clock.now + seconds
        self.busy_s += seconds
        self.num_steps += 1
        return True

    def finish_step(self) -> list[Request]:
        """Apply the step that ends now; returns the requests that finished."""
        output, self.step_output = self.step_output, None
        sampled = [_token(item.request) if item.samples else None for item in output.scheduled]

        def check_stop(request: Request) -> RequestStatus | None:
            if request.num_output_tokens < self.output_targets[request.req_id]:
                return None
            return RequestStatus.FINISHED_LENGTH if request.decode_budget == 0 else RequestStatus.FINISHED_EOS

        updated = self.scheduler.update_from_output(output, sampled, check_stop)
        finished = [request for request in updated if request.status.is_finished]
        for request in finished:
            del self.output_targets[request.req_id]
        return finished

    def warm(self, prefix: tuple[int, ...]) -> None:
        """Compute ``prefix`` once so its blocks are cached, outside simulated time."""
        self.scheduler.add_request(Request(f"warm-{zlib.crc32(bytes(str(prefix), 'ascii'))}", list(prefix), 1,
                                           ignore_eos=True))
        while self.scheduler.has_work():
            output = self.scheduler.schedule()
            sampled = [0 if item.samples else None for item in output.scheduled]
            self.scheduler.update_from_output(output, sampled, lambda request: RequestStatus.FINISHED_LENGTH)


def _token(request: Request) -> int:
    """A deterministic generated token: distinct per request and position, so outputs never collide."""
    return (request.num_tokens * 2654435761 + zlib.crc32(request.req_id.encode())) % _TOKEN_SPACE


@dataclass
class SimResult:
    policy: str
    workers: dict[str, WorkerProfile]
    records: list[RequestRecord]
    decisions: list[tuple[str, Ranking]] = field(default_factory=list)
    worker_stats: dict[str, dict] = field(default_factory=dict)
    moves: list[tuple[str, Move]] = field(default_factory=list)

    def summary(self) -> dict:
        summary = summarize(self.records, list(self.workers))
        summary["policy"] = self.policy
        summary["moves"] = len(self.moves)
        summary["offloaded_to_cpu"] = sum(n for name, n in summary["requests_per_worker"].items()
                                          if self.workers[name].kind == "cpu")
        summary["workers"] = self.worker_stats
        return summary


@dataclass
class _Placement:
    """A request on its way, and its finish as predicted where it waits when it was placed there."""

    request: WorkloadRequest
    placed_s: float
    placed_at: float
    left: tuple[str, ...] = ()  # the workers it moved away from


def simulate(workers: dict[str, WorkerProfile], workload: Workload, policy: str = "cost",
             keep_decisions: bool = False) -> SimResult:
    """Run ``workload`` through ``policy`` over simulated ``workers`` and return every request's record.

    Under ``finish_time``, as in the router, every ``CHECK_INTERVAL_S`` the waiting requests are checked for a
    move by the router's own rule (``router_svc.replacement``)."""
    decide = POLICIES[policy]
    clock = VirtualClock()
    sim_workers = [SimWorker(name, profile, clock) for name, profile in workers.items()]
    for worker in sim_workers:
        for prefix in workload.warm_prefixes:
            worker.warm(prefix)
    result = SimResult(policy, dict(workers), [])
    lengths = OutputLengths()  # learned from finished requests, as the router learns them
    pending: dict[str, _Placement] = {}
    next_check = CHECK_INTERVAL_S if policy == "finish_time" else math.inf
    steps: list[tuple[float, int, int]] = []  # (end time, worker index, tie-breaker)
    order = itertools.count()
    arrivals = iter(sorted(workload.requests, key=lambda r: r.arrival_s))
    next_arrival = next(arrivals, None)

    def start(index: int) -> None:
        worker = sim_workers[index]
        if not worker.busy and worker.start_step():
            heapq.heappush(steps, (worker.step_end, index, next(order)))

    for sequence in itertools.count():
        next_step = steps[0][0] if steps else math.inf
        arrival = next_arrival.arrival_s if next_arrival is not None else math.inf
        if pending and (steps or next_arrival is not None) and next_check < min(next_step, arrival):
            clock.now, next_check = next_check, next_check + CHECK_INTERVAL_S
            _replace_waiting(sim_workers, lengths, pending, clock.now, result)
            for index in range(len(sim_workers)):
                start(index)
        elif steps and next_step <= arrival:
            clock.now, index, _ = heapq.heappop(steps)
            worker = sim_workers[index]
            for request in worker.finish_step():
                placement = pending.pop(request.req_id)
                result.records.append(RequestRecord(request.req_id, worker.name, placement.request.arrival_s,
                                                    request.first_token_time, clock.now, request.num_output_tokens,
                                                    OK, request.num_cached_tokens))
                lengths.observe("", request.num_output_tokens, request.max_new_tokens)
            start(index)
        elif next_arrival is not None:
            request, next_arrival = next_arrival, next(arrivals, None)
            clock.now = request.arrival_s
            if next_check < clock.now:  # no check while nothing was on its way
                next_check = clock.now + CHECK_INTERVAL_S
            _route(request, sim_workers, decide, sequence, lengths, result, pending, keep_decisions)
            for index in range(len(sim_workers)):
                start(index)
        else:
            break
    if pending:
        raise RuntimeError(f"simulation stalled with {len(pending)} requests unfinished (first: {next(iter(pending))})")
    for worker in sim_workers:
        result.worker_stats[worker.name] = {
            "kind": worker.profile.kind,
            "busy_s": worker.busy_s,
            "steps": worker.num_steps,
            "preemptions": worker.num_preemptions,
            "max_running": worker.max_running,
            "max_active_requests": worker.profile.scheduler.max_active_requests,
            "kv_blocks": worker.profile.num_kv_blocks,
            "prefill_tok_s": worker.rates.prefill_tok_s,
            "decode_tok_s": worker.rates.decode_tok_s,
        }
    return result


def _route(request: WorkloadRequest, workers: list[SimWorker], decide, sequence: int, lengths: OutputLengths,
           result: SimResult, pending: dict, keep_decisions: bool) -> None:
    eligible = [w for w in workers if w.fits(request)]
    views = [w.view(request.prompt_token_ids) for w in eligible]
    route_input = _route_input(request, lengths, sequence)
    try:
        decision = decide(views, route_input)
    except NoEligibleWorker:
        status = "INVALID_ARGUMENT" if not eligible else "UNAVAILABLE"
        result.records.append(RequestRecord(request.req_id, "", request.arrival_s, None, request.arrival_s, 0, status))
        return
    worker = next(w for w in eligible if w.name == decision.chosen)
    try:
        worker.add(request)
    except QueueFullError:
        result.records.append(RequestRecord(request.req_id, worker.name, request.arrival_s, None, request.arrival_s,
                                            0, "RESOURCE_EXHAUSTED"))
        return
    chosen = next(score for score in decision.scores if score.worker == worker.name)
    pending[request.req_id] = _Placement(request, chosen.score, request.arrival_s)
    if keep_decisions:
        result.decisions.append((request.req_id, decision))


def _route_input(request: WorkloadRequest, lengths: OutputLengths, sequence: int = 0) -> RouteInput:
    return RouteInput(len(request.prompt_token_ids), request.max_new_tokens, sequence,
                      lengths.expected_tokens("", request.max_new_tokens), lengths.fraction())


def _replace_waiting(workers: list[SimWorker], lengths: OutputLengths, pending: dict[str, _Placement], now: float,
                     result: SimResult) -> None:
    """One round of the router's re-placement check (``candidates``, ``plan_moves``), its moves made at once."""
    by_name = {worker.name: worker for worker in workers}
    reports = {worker.name: worker.report() for worker in workers}
    waiting = {}
    for worker in workers:
        for engine_request in worker.scheduler.waiting:
            placement = pending[engine_request.req_id]
            unfit = tuple(other.name for other in workers if not other.fits(placement.request))
            waiting[engine_request.req_id] = Waiting(engine_request.req_id, _route_input(placement.request, lengths),
                                                     worker.name, placement.placed_s, placement.placed_at,
                                                     len(placement.left), frozenset(placement.left + unfit))
    considered = candidates(waiting, reports)
    cached = {}
    for entry in considered:
        prompt = pending[entry.request_id].request.prompt_token_ids
        for name in reports.keys() - entry.excluded - {entry.worker}:
            prefix = by_name[name].scheduler.cached_prefix(prompt)
            cached[entry.request_id, name] = (prefix.tokens, prefix.evictable_tokens)
    for entry, move in plan_moves(considered, reports, {}, cached, now):
        source, target = by_name[entry.worker], by_name[move.to_worker]
        placement = pending[entry.request_id]
        try:
            target.add(placement.request)
        except QueueFullError:
            continue
        engine_request = next(r for r in source.scheduler.waiting if r.req_id == entry.request_id)
        source.scheduler.finish(engine_request, RequestStatus.FINISHED_ABORTED)
        del source.output_targets[entry.request_id]
        pending[entry.request_id] = _Placement(placement.request, move.to_s, now, placement.left + (source.name,))
        result.moves.append((entry.request_id, move))
