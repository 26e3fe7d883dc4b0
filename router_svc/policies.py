"""Routing policies: pure functions of the workers' views plus the request.

Each policy scores every eligible worker (lower is better) and picks the minimum; ties go to the
faster worker (higher decode rate, then higher prefill rate), then to the name for determinism. ``route``
turns a policy's ranking into the ``RoutingDecision`` record, every known worker listed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router_svc.failover import Failover, WorkerStatus
from router_svc.worker_view import WorkerView
from tandem.decision import RoutingDecision, WorkerScore
from tandem.step_time import step_budget, step_seconds


@dataclass(frozen=True)
class RouteInput:
    """The request as the policies see it.

    ``expected_new_tokens``: what it is expected to generate (learned, ``router_svc.output_lengths``; 0:
    the whole budget). ``output_fraction``: the share of their remaining budgets queued requests are
    expected to use. Both price the output the request is expected to produce, not its budget.
    ``samples``: the outputs it asks of its prompt (``n``), each expected to be that long; the prompt is
    computed once, the samples after the first compute only what follows its last full cache block.
    ``constrained``: it has a structured output, whose mask each of its steps pays.
    """

    prompt_tokens: int
    max_new_tokens: int
    sequence: int = 0  # how many requests the router routed before this one (round_robin)
    expected_new_tokens: int = 0
    output_fraction: float = 1.0
    samples: int = 1
    constrained: bool = False

    @property
    def expected_output(self) -> int:
        return self.expected_new_tokens or self.max_new_tokens

    def expected_remaining(self, decode_budget: int) -> int:
        """A queued request's expected remaining output, from its remaining budget."""
        return min(decode_budget, math.ceil(decode_budget * self.output_fraction))


@dataclass(frozen=True)
class Score:
    worker: str
    score: float
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class Ranking:
    """A policy's choice, and every worker's score, best first."""

    policy: str
    chosen: str
    scores: tuple[Score, ...] = field(default_factory=tuple)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Evictions:
    """The queue's prefill and the new prompt's cache hit once evictions are counted (``play_evictions``)."""

    prefill_tokens: tuple[int, ...]  # per queued request, in queue order
    cached_tokens: int  # of the new prompt


def play_evictions(view: WorkerView, request: RouteInput) -> Evictions:
    """Walks the queue in order. Each request takes new KV blocks for its uncomputed prompt and expected
    output: first the free blocks that cache nothing, then by evicting cached ones. A waiting request's
    cache hit, and the new prompt's evictable one (blocks no request holds), count only as far as the
    requests ahead of it have not needed to evict: a hit that queued work will evict first is no hit,
    and its tokens are prefilled instead.
    """
    report = view.report
    prefill = [work.prefill_tokens for work in view.queue]
    if not report.kv_blocks_total:
        return Evictions(tuple(prefill), view.cached_tokens)
    spare = report.kv_blocks_total - report.kv_blocks_used - report.kv_blocks_cached
    demand = 0

    def evicted(cached_tokens: int) -> int:
        return min(cached_tokens, max(0, demand - spare) * report.block_size)

    for index, work in enumerate(view.queue):
        if not work.running:
            prefill[index] += evicted(work.cached_tokens)
        demand += _blocks(prefill[index] + request.expected_remaining(work.decode_tokens), report.block_size)
    return Evictions(tuple(prefill), view.cached_tokens - evicted(view.cached_evictable_tokens))


def cost_score(view: WorkerView, request: RouteInput) -> Score:
    """The article's score: remaining prefill / prefill rate + remaining decode / decode rate, the decode
    work being the output expected of the queue and of the request (their budgets until it is learned),
    and the prefill grown by the cache hits the queue will evict first (``play_evictions``)."""
    evictions = play_evictions(view, request)
    prefill_tokens = sum(evictions.prefill_tokens) + max(0, request.prompt_tokens - evictions.cached_tokens)
    decode_tokens = sum(request.expected_remaining(work.decode_tokens) for work in view.queue) \
        + request.expected_output * request.samples
    constrained_tokens = sum(request.expected_remaining(work.decode_tokens) for work in view.queue if work.constrained) \
        + (request.expected_output * request.samples if request.constrained else 0)
    prefill_s = prefill_tokens / view.report.prefill_tok_s
    decode_s = decode_tokens / view.report.decode_tok_s + constrained_tokens * view.report.step_per_constrained_row_s
    return Score(view.name, prefill_s + decode_s, prefill_s, decode_s)


def finish_time_score(view: WorkerView, request: RouteInput) -> Score:
    """Predicted seconds until the new request finishes on this worker.

    Plays the worker's queue forward with its slots (``max_active_requests``), its per-step token
    budget and its step-time model (``tandem.step_time``): a step costs base + per_prefill_token * prefill
    tokens + per_decode * decoding requests, or its own line where it is small enough. Unlike the cost
    score, this sees the wait for a free slot and that a batch decodes in parallel. Outputs are the expected
    ones (``RouteInput``), at least one token.

    KV capacity: a waiting request starts only when the blocks it will take (its uncomputed prompt and
    expected output) fit beside those the running ones hold; each frees its blocks when it finishes. The
    blocks of requests running now are their share of the worker's used blocks. Cached tokens count as
    far as the queue ahead does not evict them first (``play_evictions``).
    """
    return Score(view.name, _play_forward(view, request, None))


def queued_finish_time(view: WorkerView, request_id: str, request: RouteInput) -> float | None:
    """Predicted seconds until ``request``, already queued on this worker as ``request_id`` and generating
    its expected output, finishes where it stands (``finish_time_score``'s model); None when the view
    does not show it."""
    index = next((i for i, work in enumerate(view.queue) if work.request_id == request_id), None)
    return None if index is None else _play_forward(view, request, index)


def _play_forward(view: WorkerView, request: RouteInput, queued_index: int | None) -> float:
    """Seconds until the target finishes: the queue entry at ``queued_index``, or (None) ``request``
    appended as a new arrival."""
    report = view.report
    slots = max(1, report.max_active_requests)
    capacity = report.kv_blocks_total or math.inf
    held_each = report.kv_blocks_used / max(1, view.num_running)
    # each entry: [prefill tokens left, decode tokens left, KV blocks held once running, mask seconds per token]
    evictions = play_evictions(view, request)

    def masking(constrained: bool) -> float:
        return report.step_per_constrained_row_s if constrained else 0.0

    running, waiting = [], []
    for index, (work, prefill) in enumerate(zip(view.queue, evictions.prefill_tokens)):
        decode = request.expected_output if index == queued_index else max(1, request.expected_remaining(work.decode_tokens))
        if work.running:
            running.append([prefill, decode, held_each, masking(work.constrained)])
        else:
            waiting.append([prefill, decode, _blocks(prefill + decode, report.block_size), masking(work.constrained)])
        if index == queued_index:
            targets = [(running if work.running else waiting)[-1]]
    if queued_index is None:
        output, mask = request.expected_output, masking(request.constrained)
        uncached = max(1, request.prompt_tokens - evictions.cached_tokens)
        after_shared = request.prompt_tokens - (request.prompt_tokens - 1) // report.block_size * report.block_size
        targets = [[uncached, output, _blocks(uncached + output, report.block_size), mask],
                   *([after_shared, output, _blocks(after_shared + output, report.block_size), mask]
                     for _ in range(request.samples - 1))]
        waiting.extend(targets)
    held = sum(work[2] for work in running)
    clock = 0.0
    while True:
        while waiting and len(running) < slots and (not running or held + waiting[0][2] <= capacity):
            held += waiting[0][2]
            running.append(waiting.pop(0))
        if all(work[0] == 0 for work in running):
            steps = min(work[1] for work in running)  # only decodes: jump to the next completion
            clock += steps * (step_seconds(report, 0, len(running)) + sum(work[3] for work in running))
            for work in running:
                work[1] -= steps
        else:
            # As the worker's scheduler: running requests in order, each taking its tokens (1 for a
            # decode) from the step's token budget until it runs out; where none decodes, the first may
            # take a longer chunk by itself. One-token items cost as decodes.
            decoding = any(work[0] == 0 for work in running)
            budget = max(1, step_budget(report, decoding, used=0))
            used, prefill_tokens, decodes, masks = 0, 0, 0, 0.0
            for work in running:
                if budget == 0:
                    break
                chunk = 1 if work[0] == 0 else min(work[0], budget)
                used += chunk
                budget = step_budget(report, decoding, used)
                if chunk == 1:
                    decodes += 1
                else:
                    prefill_tokens += chunk
                if work[0] == 0:
                    work[1] -= 1
                    masks += work[3]
                else:
                    work[0] -= chunk
                    if work[0] == 0:
                        work[1] -= 1  # the last prefill chunk samples the first token
                        masks += work[3]
            clock += step_seconds(report, prefill_tokens, decodes) + masks
        if all(target[1] <= 0 for target in targets):
            return clock
        held -= sum(work[2] for work in running if work[1] <= 0)
        running = [work for work in running if work[1] > 0]


def least_loaded_score(view: WorkerView, request: RouteInput) -> Score:
    return Score(view.name, float(view.num_running + view.num_waiting))


def cache_aware_score(view: WorkerView, request: RouteInput) -> Score:
    """Most cached prompt tokens wins; among equal hits the cost score decides."""
    return Score(view.name, -view.cached_tokens + cost_score(view, request).score / 1e6)


def gpu_only_score(view: WorkerView, request: RouteInput) -> Score:
    """GPU workers only (the baseline without offload); among them the cost score decides."""
    if view.kind != "gpu":
        return Score(view.name, math.inf)
    return cost_score(view, request)


def _faster_first(view: WorkerView) -> tuple:
    return (-view.report.decode_tok_s, -view.report.prefill_tok_s, view.name)


def _choose(policy: str, views: Sequence[WorkerView], scores: list[Score]) -> Ranking:
    by_name = {view.name: view for view in views}
    ranked = sorted(scores, key=lambda s: (s.score, *_faster_first(by_name[s.worker])))
    finite = [s for s in ranked if math.isfinite(s.score)]
    if not finite:
        raise NoEligibleWorker(f"policy {policy} found no eligible worker")
    return Ranking(policy, finite[0].worker, tuple(ranked))


def _scored(policy: str, score: Callable[[WorkerView, RouteInput], Score]):
    def decide(views: Sequence[WorkerView], request: RouteInput) -> Ranking:
        if not views:
            raise NoEligibleWorker("no healthy worker")
        return _choose(policy, views, [score(view, request) for view in views])

    return decide


def round_robin(views: Sequence[WorkerView], request: RouteInput) -> Ranking:
    if not views:
        raise NoEligibleWorker("no healthy worker")
    ordered = sorted(views, key=lambda v: v.name)
    chosen = ordered[request.sequence % len(ordered)].name
    scores = tuple(Score(v.name, 0.0 if v.name == chosen else 1.0) for v in ordered)
    return Ranking("round_robin", chosen, tuple(sorted(scores, key=lambda s: s.score)))


class NoEligibleWorker(RuntimeError):
    """No worker can take the request under this policy."""


POLICIES: dict[str, Callable[[Sequence[WorkerView], RouteInput], Ranking]] = {
    "cost": _scored("cost", cost_score),
    "finish_time": _scored("finish_time", finish_time_score),
    "round_robin": round_robin,
    "least_loaded": _scored("least_loaded", least_loaded_score),
    "cache_aware": _scored("cache_aware", cache_aware_score),
    "gpu_only": _scored("gpu_only", gpu_only_score),
}
DEFAULT_POLICY = "finish_time"  # by evidence: make bench-matrix (docs/benchmarks.md)


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
    return WorkerScore(view.name, view.kind, eligible, reason="" if eligible else f"excluded by policy {policy}",
                       score_s=score.score if eligible else 0.0, prefill_s=score.prefill_s, decode_s=score.decode_s,
                       **view.score_parts())
