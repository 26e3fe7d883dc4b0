"""Unit tests for the router's routing policies (router_svc/policies.py): pure Python, no worker needed."""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import fields

import pytest

from router_svc.policies import (
    DEFAULT_POLICY,
    POLICIES,
    Evictions,
    NoEligibleWorker,
    RouteInput,
    cost_score,
    finish_time_score,
    play_evictions,
)
from router_svc.worker_view import QueuedWork, WorkerReport, WorkerView

REPORT_FIELDS = {f.name for f in fields(WorkerReport)}


def make_view(name: str = "w", kind: str = "gpu", *, pending_prefill_tokens: int = 0, pending_decode_tokens: int = 0,
              num_running: int = 0, num_waiting: int = 0, inflight_requests: int = 0, **values) -> WorkerView:
    """A view whose queue has these totals: ``num_running`` running and ``num_waiting`` waiting requests (the last
    ``inflight_requests`` of them credited), prefill on the waiting ones (else the running ones), decode spread
    over all. Totals without requests sit on one running request. An explicit ``queue`` is used as it is. Every
    other keyword is a field of the report or of the view."""
    report = dict(max_active_requests=8, prefill_tok_s=1000.0, decode_tok_s=100.0)
    report.update({key: value for key, value in values.items() if key in REPORT_FIELDS})
    view = {key: value for key, value in values.items() if key not in REPORT_FIELDS and key != "queue"}
    queue = values.get("queue")
    if queue is None:
        running = [[True, 0, 0, False] for _ in range(num_running)]
        waiting = [[False, 0, 0, index >= num_waiting - inflight_requests] for index in range(num_waiting)]
        if not running and not waiting and (pending_prefill_tokens or pending_decode_tokens):
            running = [[True, 0, 0, False]]
        queue = running + waiting
        prefill_holders = waiting or running
        for index, work in enumerate(prefill_holders):
            work[1] = pending_prefill_tokens // len(prefill_holders) + (index < pending_prefill_tokens % len(prefill_holders))
        for index, work in enumerate(queue):
            work[2] = pending_decode_tokens // len(queue) + (index < pending_decode_tokens % len(queue))
        queue = tuple(QueuedWork(*work) for work in queue)
    requests = tuple(work for work in queue if not work.credited)
    credited = tuple(work for work in queue if work.credited)
    assert queue == requests + credited, "credited work follows the reported requests"
    return WorkerView(WorkerReport(name=name, kind=kind, requests=requests, **report), credited=credited, **view)


def scores_by_worker(decision) -> dict[str, float]:
    return {score.worker: score.score for score in decision.scores}


# --- cost: the worked example of DESIGN.md ------------------------------------------------------------

PROMPT, CACHED, NEW = 516, 496, 128
EXAMPLE_REQUEST = RouteInput(prompt_tokens=PROMPT, max_new_tokens=NEW)
CPU_IDLE = make_view(
    "cpu", "cpu", cached_tokens=CACHED, prefill_tok_s=73.0, decode_tok_s=45.0, max_active_requests=4
)


def gpu_view(running_budget: int, num_waiting: int) -> WorkerView:
    """4 running requests with ``running_budget`` decode tokens left in total, plus waiting ones of
    20 uncached prompt tokens and 128 new tokens each."""
    return make_view(
        "gpu",
        "gpu",
        cached_tokens=CACHED,
        pending_prefill_tokens=20 * num_waiting,
        pending_decode_tokens=running_budget + 128 * num_waiting,
        num_running=4,
        num_waiting=num_waiting,
        max_active_requests=8,
        prefill_tok_s=2551.0,
        decode_tok_s=293.0,
    )


def test_finish_time_is_the_default_policy():  # chosen by make bench-matrix
    assert DEFAULT_POLICY == "finish_time"
    assert DEFAULT_POLICY in POLICIES


def test_worked_example_cpu_idle_score():
    score = cost_score(CPU_IDLE, EXAMPLE_REQUEST)
    assert score.worker == "cpu"
    assert score.prefill_s == pytest.approx(20 / 73, abs=1e-12)
    assert score.decode_s == pytest.approx(128 / 45, abs=1e-12)
    assert score.score == pytest.approx(3.118, abs=5e-4)


def test_worked_example_gpu_with_two_waiting_wins():
    gpu = gpu_view(running_budget=496, num_waiting=2)
    assert (gpu.pending_prefill_tokens, gpu.pending_decode_tokens) == (40, 752)
    score = cost_score(gpu, EXAMPLE_REQUEST)
    assert score.prefill_s == pytest.approx(60 / 2551, abs=1e-12)
    assert score.decode_s == pytest.approx(880 / 293, abs=1e-12)
    assert score.score == pytest.approx(3.027, abs=5e-4)

    decision = POLICIES["cost"]([CPU_IDLE, gpu], EXAMPLE_REQUEST)
    assert decision.policy == "cost"
    assert decision.chosen == "gpu"
    assert [s.worker for s in decision.scores] == ["gpu", "cpu"]
    assert scores_by_worker(decision)["gpu"] == pytest.approx(3.027, abs=5e-4)
    assert scores_by_worker(decision)["cpu"] == pytest.approx(3.118, abs=5e-4)


def test_worked_example_fifty_ms_later_cpu_wins():
    gpu = gpu_view(running_budget=488, num_waiting=3)
    assert (gpu.pending_prefill_tokens, gpu.pending_decode_tokens) == (60, 872)
    score = cost_score(gpu, EXAMPLE_REQUEST)
    assert score.prefill_s == pytest.approx(80 / 2551, abs=1e-12)
    assert score.decode_s == pytest.approx(1000 / 293, abs=1e-12)
    assert score.score == pytest.approx(3.444, abs=5e-4)

    decision = POLICIES["cost"]([gpu, CPU_IDLE], EXAMPLE_REQUEST)
    assert decision.chosen == "cpu"
    assert [s.worker for s in decision.scores] == ["cpu", "gpu"]
    assert scores_by_worker(decision)["gpu"] == pytest.approx(3.444, abs=5e-4)


def test_cost_never_counts_negative_uncached_tokens():
    view = make_view(cached_tokens=600, prefill_tok_s=10.0, decode_tok_s=10.0, pending_prefill_tokens=30)
    score = cost_score(view, RouteInput(prompt_tokens=500, max_new_tokens=20))
    assert score.prefill_s == pytest.approx(3.0)  # only the pending 30; the new prompt is fully cached
    assert score.decode_s == pytest.approx(2.0)


# --- tie-break ------------------------------------------------------------------------------------------


def test_cost_tie_goes_to_the_faster_decoder_not_the_name():
    request = RouteInput(prompt_tokens=0, max_new_tokens=100)
    slow = make_view("a-slow", decode_tok_s=100.0, prefill_tok_s=5000.0)
    fast = make_view("z-fast", decode_tok_s=200.0, prefill_tok_s=10.0, pending_decode_tokens=100)
    decision = POLICIES["cost"]([slow, fast], request)
    assert scores_by_worker(decision) == {"a-slow": 1.0, "z-fast": 1.0}  # an exact tie
    assert decision.chosen == "z-fast"
    assert [s.worker for s in decision.scores] == ["z-fast", "a-slow"]


def test_tie_with_equal_decode_rate_goes_to_the_faster_prefill():
    request = RouteInput(prompt_tokens=10, max_new_tokens=10)
    a = make_view("a", num_running=2, decode_tok_s=50.0, prefill_tok_s=100.0)
    b = make_view("b", num_running=1, num_waiting=1, decode_tok_s=50.0, prefill_tok_s=400.0)
    decision = POLICIES["least_loaded"]([a, b], request)
    assert scores_by_worker(decision) == {"a": 2.0, "b": 2.0}
    assert decision.chosen == "b"


def test_tie_with_equal_rates_goes_to_the_name():
    request = RouteInput(prompt_tokens=10, max_new_tokens=10)
    views = [make_view(name, num_running=1) for name in ("c", "a", "b")]
    for policy in ("cost", "least_loaded", "cache_aware", "gpu_only", "finish_time"):
        decision = POLICIES[policy](views, request)
        assert decision.chosen == "a", policy
        assert [s.worker for s in decision.scores] == ["a", "b", "c"], policy


# --- least_loaded, cache_aware, gpu_only, round_robin ---------------------------------------------------


def test_least_loaded_counts_running_and_waiting_requests_credit_included_once():
    request = RouteInput(prompt_tokens=10, max_new_tokens=10)
    a = make_view("a", num_running=3, decode_tok_s=1000.0)
    b = make_view("b", num_running=1, num_waiting=3, inflight_requests=2)  # 1 waiting reported, 2 credited
    c = make_view("c", num_waiting=2, inflight_requests=1, pending_decode_tokens=10**6)  # 2, heavy in tokens
    decision = POLICIES["least_loaded"]([a, b, c], request)
    assert scores_by_worker(decision) == {"a": 3.0, "b": 4.0, "c": 2.0}
    assert decision.chosen == "c"
    assert POLICIES["least_loaded"]([a, b], request).chosen == "a"


def test_cache_aware_prefers_the_most_cached_tokens():
    request = RouteInput(prompt_tokens=512, max_new_tokens=64)
    warm_but_busy = make_view(
        "z", cached_tokens=256, pending_decode_tokens=5000, pending_prefill_tokens=4000, decode_tok_s=10.0
    )
    cold_and_idle = make_view("a", cached_tokens=128, decode_tok_s=1000.0, prefill_tok_s=10_000.0)
    assert cost_score(cold_and_idle, request).score < cost_score(warm_but_busy, request).score
    assert POLICIES["cache_aware"]([cold_and_idle, warm_but_busy], request).chosen == "z"


def test_cache_aware_breaks_equal_hits_by_cost():
    request = RouteInput(prompt_tokens=512, max_new_tokens=64)
    busy = make_view("a", cached_tokens=256, pending_decode_tokens=1000, decode_tok_s=1000.0)
    idle = make_view("b", cached_tokens=256, decode_tok_s=100.0)  # slower, but idle: cheaper by cost
    assert cost_score(idle, request).score < cost_score(busy, request).score
    decision = POLICIES["cache_aware"]([busy, idle], request)
    assert decision.chosen == "b"
    assert [s.worker for s in decision.scores] == ["b", "a"]


def test_gpu_only_never_picks_a_cpu_worker():
    request = RouteInput(prompt_tokens=100, max_new_tokens=10)
    cpu = make_view("a-cpu", "cpu", cached_tokens=100, decode_tok_s=10_000.0, prefill_tok_s=10_000.0)
    busy_gpu = make_view("g1", "gpu", pending_decode_tokens=10_000)
    idle_gpu = make_view("g2", "gpu")
    assert cost_score(cpu, request).score < cost_score(idle_gpu, request).score
    decision = POLICIES["gpu_only"]([cpu, busy_gpu, idle_gpu], request)
    assert decision.chosen == "g2"
    assert math.isinf(scores_by_worker(decision)["a-cpu"])
    assert scores_by_worker(decision)["g1"] == pytest.approx(cost_score(busy_gpu, request).score)


def test_gpu_only_without_a_gpu_worker_raises():
    request = RouteInput(prompt_tokens=100, max_new_tokens=10)
    with pytest.raises(NoEligibleWorker):
        POLICIES["gpu_only"]([make_view("c1", "cpu"), make_view("c2", "cpu")], request)


def test_round_robin_cycles_in_name_order_by_sequence():
    views = [make_view("c"), make_view("a"), make_view("b")]
    chosen = [POLICIES["round_robin"](views, RouteInput(10, 10, sequence=s)).chosen for s in range(7)]
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]
    decision = POLICIES["round_robin"](views, RouteInput(10, 10, sequence=4))
    assert decision.policy == "round_robin"
    assert decision.scores[0].worker == "b"
    assert scores_by_worker(decision) == {"a": 1.0, "b": 0.0, "c": 1.0}


def test_round_robin_ignores_load():
    views = [make_view("a", num_running=100, pending_decode_tokens=10**6), make_view("b")]
    assert POLICIES["round_robin"](views, RouteInput(10, 10, sequence=0)).chosen == "a"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_raises_on_no_worker(policy):
    with pytest.raises(NoEligibleWorker):
        POLICIES[policy]([], RouteInput(prompt_tokens=10, max_new_tokens=10))


# --- finish_time: hand computations ---------------------------------------------------------------------

BASE, PER_PREFILL, PER_DECODE = 0.01, 0.001, 0.002


def step_view(name: str = "w", **fields) -> WorkerView:
    values = dict(
        step_base_s=BASE, step_per_prefill_token_s=PER_PREFILL, step_per_decode_s=PER_DECODE, max_num_batched_tokens=32
    )
    values.update(fields)
    return make_view(name, **values)


def test_finish_time_idle_worker_matches_hand_computation():
    # 100 uncached tokens in chunks of 32: 32, 32, 32, 4 (the last one samples the first token),
    # then 4 more decode steps of one request each.
    score = finish_time_score(step_view(), RouteInput(prompt_tokens=100, max_new_tokens=5))
    expected = 4 * BASE + 100 * PER_PREFILL + 4 * (BASE + PER_DECODE)
    assert score.worker == "w"
    assert score.score == pytest.approx(expected, rel=1e-12)


def test_finish_time_runs_a_lone_prompt_in_chunks_of_the_prefill_step_budget():
    # 100 uncached tokens alone in chunks of 64: 64, 36, then 4 decode steps
    score = finish_time_score(step_view(max_prefill_step_tokens=64), RouteInput(prompt_tokens=100, max_new_tokens=5))
    assert score.score == pytest.approx(2 * BASE + 100 * PER_PREFILL + 4 * (BASE + PER_DECODE), rel=1e-12)


def test_finish_time_prices_small_steps_on_their_own_line():
    # As above, on a worker whose steps of up to 4 rows take another path: the last chunk of 4 tokens and
    # the 4 decode steps are small.
    small_base, small_per_row = 0.002, 0.0005
    view = step_view(small_step_rows=4, small_step_base_s=small_base, small_step_per_row_s=small_per_row)
    score = finish_time_score(view, RouteInput(prompt_tokens=100, max_new_tokens=5))
    expected = 3 * BASE + 96 * PER_PREFILL + (small_base + 4 * small_per_row) + 4 * (small_base + small_per_row)
    assert score.score == pytest.approx(expected, rel=1e-12)


def test_finish_time_one_new_token_is_just_the_prefill():
    score = finish_time_score(step_view(), RouteInput(prompt_tokens=64, max_new_tokens=1))
    assert score.score == pytest.approx(2 * BASE + 64 * PER_PREFILL, rel=1e-12)


def test_finish_time_cached_tokens_reduce_the_prefill():
    request = RouteInput(prompt_tokens=100, max_new_tokens=5)
    decode = 4 * (BASE + PER_DECODE)
    cold = finish_time_score(step_view(cached_tokens=0), request).score
    warm = finish_time_score(step_view(cached_tokens=64), request).score  # 36 tokens: chunks 32, 4
    full = finish_time_score(step_view(cached_tokens=100), request).score  # one token is recomputed
    over = finish_time_score(step_view(cached_tokens=500), request).score
    assert warm == pytest.approx(2 * BASE + 36 * PER_PREFILL + decode, rel=1e-12)
    assert full == pytest.approx(BASE + PER_DECODE + decode, rel=1e-12)  # a one-token step costs as a decode
    assert over == pytest.approx(full, rel=1e-12)
    assert full < warm < cold


def test_samples_compute_the_prompt_once_and_decode_side_by_side():
    # n = 3 of a 40-token prompt: the first computes it (32, then 8 tokens), the other two the 8 tokens after
    # its last full block of 16 beside that second chunk; then 4 decode steps of all three.
    view = step_view(block_size=16)
    score = finish_time_score(view, RouteInput(prompt_tokens=40, max_new_tokens=5, samples=3)).score
    assert score == pytest.approx(2 * BASE + (40 + 2 * 8) * PER_PREFILL + 4 * (BASE + 3 * PER_DECODE), rel=1e-12)
    one, three = (cost_score(view, RouteInput(prompt_tokens=40, max_new_tokens=5, samples=n)) for n in (1, 3))
    assert three.prefill_s == one.prefill_s and three.decode_s == pytest.approx(3 * one.decode_s)


def test_a_structured_output_pays_its_mask_in_every_step_it_samples():
    mask = 0.003
    view = step_view(step_per_constrained_row_s=mask)
    free = RouteInput(prompt_tokens=100, max_new_tokens=5)
    held = RouteInput(prompt_tokens=100, max_new_tokens=5, constrained=True)
    # 5 tokens sampled (the last prefill chunk's, then 4 decodes): 5 masks.
    assert finish_time_score(view, held).score == pytest.approx(finish_time_score(view, free).score + 5 * mask)
    assert cost_score(view, held).decode_s == pytest.approx(cost_score(view, free).decode_s + 5 * mask)
    queued = step_view(step_per_constrained_row_s=mask, queue=(QueuedWork(True, 0, 10, constrained=True),),
                       num_running=1)
    plain_queue = step_view(step_per_constrained_row_s=mask, queue=(QueuedWork(True, 0, 10),), num_running=1)
    assert finish_time_score(queued, free).score > finish_time_score(plain_queue, free).score


def test_finish_time_full_worker_waits_for_a_slot():
    base, per_prefill, per_decode = 0.01, 1e-4, 1e-4
    queue = (QueuedWork(True, 0, 10), QueuedWork(True, 0, 20))
    request = RouteInput(prompt_tokens=8, max_new_tokens=4)
    common = dict(
        step_base_s=base, step_per_prefill_token_s=per_prefill, step_per_decode_s=per_decode,
        max_num_batched_tokens=64, queue=queue, num_running=2,
    )
    full = finish_time_score(step_view(max_active_requests=2, **common), request).score
    free = finish_time_score(step_view(max_active_requests=3, **common), request).score
    # Full: 10 steps of the two running, then prefill beside the survivor, then 3 decodes of two.
    assert full == pytest.approx(
        10 * (base + 2 * per_decode) + (base + 8 * per_prefill + per_decode) + 3 * (base + 2 * per_decode), rel=1e-12
    )
    # Free: prefill beside both at once, then 3 decodes of three.
    assert free == pytest.approx((base + 8 * per_prefill + 2 * per_decode) + 3 * (base + 3 * per_decode), rel=1e-12)
    shortest_remaining_steps = 10
    assert full - free >= shortest_remaining_steps * base


def test_finish_time_shares_decode_steps_in_a_batch():
    base, per_prefill, per_decode = 0.01, 1e-4, 1e-4
    request = RouteInput(prompt_tokens=8, max_new_tokens=20)
    fields = dict(step_base_s=base, step_per_prefill_token_s=per_prefill, step_per_decode_s=per_decode)
    single = finish_time_score(step_view(**fields), request).score
    busy_view = step_view(queue=tuple(QueuedWork(True, 0, 50) for _ in range(3)), num_running=3, **fields)
    batched = finish_time_score(busy_view, request).score
    assert single == pytest.approx(base + 8 * per_prefill + 19 * (base + per_decode), rel=1e-12)
    assert batched == pytest.approx(base + 8 * per_prefill + 3 * per_decode + 19 * (base + 4 * per_decode), rel=1e-12)
    assert single < batched < 1.1 * single  # far below 4x: the running requests do not serialize it


def test_finish_time_policy_decision_uses_the_prediction():
    request = RouteInput(prompt_tokens=8, max_new_tokens=4)
    full = step_view("a", max_active_requests=1, queue=(QueuedWork(True, 0, 100),), num_running=1)
    idle = step_view("b")
    decision = POLICIES["finish_time"]([full, idle], request)
    assert decision.policy == "finish_time"
    assert decision.chosen == "b"
    assert scores_by_worker(decision) == {
        "a": finish_time_score(full, request).score,
        "b": finish_time_score(idle, request).score,
    }


# --- finish_time against a step-by-step simulation ------------------------------------------------------


class _Work:
    def __init__(self, prefill: int, budget: int):
        self.prefill = prefill  # prompt tokens still to compute
        self.generated = 0
        self.budget = budget  # tokens it may generate

    @property
    def done(self) -> bool:
        return self.generated >= self.budget


def simulate_finish_time(view: WorkerView, request: RouteInput) -> float:
    """One step at a time, no jumping, as tandem.engine.scheduler schedules: FCFS admission into
    ``max_active_requests`` slots; running requests served in order, each taking its tokens (one for a
    decode) from ``max_num_batched_tokens`` until it runs out; where none decodes, the first takes up to
    ``max_prefill_step_tokens`` by itself, if that is larger. A step costs base + per-token * prefill
    tokens + per-decode * one-token items (the step-time model counts a one-token chunk as a decode), or, with
    at most ``small_step_rows`` rows in all, small-base + small-per-row * rows."""
    running = deque(_Work(w.prefill_tokens, w.decode_tokens) for w in view.queue if w.running)
    waiting = deque(_Work(w.prefill_tokens, w.decode_tokens) for w in view.queue if not w.running)
    target = _Work(max(1, request.prompt_tokens - view.cached_tokens), request.max_new_tokens)
    waiting.append(target)
    clock = 0.0
    for _ in range(100_000):
        while waiting and len(running) < view.report.max_active_requests:
            running.append(waiting.popleft())
        report = view.report
        decoding = any(work.prefill == 0 for work in running)
        budget = report.max_num_batched_tokens
        if not decoding:  # the first may take a longer chunk by itself
            budget = max(report.max_num_batched_tokens, report.max_prefill_step_tokens)
        prefill_tokens = decodes = 0
        for index, work in enumerate(running):
            if index == 1 and not decoding:  # the rest share what is left of the usual budget
                budget = report.max_num_batched_tokens - (prefill_tokens + decodes)
            if budget <= 0:
                break
            if work.prefill == 0:
                decodes += 1
                work.generated += 1
                budget -= 1
            else:
                chunk = min(work.prefill, budget)
                work.prefill -= chunk
                budget -= chunk
                if chunk == 1:
                    decodes += 1
                else:
                    prefill_tokens += chunk
                if work.prefill == 0:
                    work.generated += 1
        if prefill_tokens + decodes <= report.small_step_rows:
            clock += report.small_step_base_s + report.small_step_per_row_s * (prefill_tokens + decodes)
        else:
            clock += report.step_base_s + report.step_per_prefill_token_s * prefill_tokens \
                + report.step_per_decode_s * decodes
        if target.done:
            return clock
        running = deque(work for work in running if not work.done)
    raise AssertionError("simulation did not finish")


def random_scenario(rng: random.Random) -> tuple[WorkerView, RouteInput]:
    slots = rng.randint(1, 4)
    queue = []
    for _ in range(rng.randint(0, slots)):
        decoding = rng.random() < 0.6
        queue.append(QueuedWork(True, 0 if decoding else rng.randint(1, 40), rng.randint(1, 12)))
    for _ in range(rng.randint(0, 4)):
        queue.append(QueuedWork(False, rng.randint(1, 40), rng.randint(1, 12)))
    prompt = rng.randint(1, 60)
    small_step_rows = rng.choice([0, rng.randint(1, 8)])
    view = make_view(
        f"s{rng.random():.6f}",
        cached_tokens=rng.choice([0, 0, rng.randint(0, prompt), prompt]),
        max_active_requests=slots,
        max_num_batched_tokens=rng.randint(4, 32),
        max_prefill_step_tokens=rng.choice([0, rng.randint(4, 64)]),
        step_base_s=rng.uniform(1e-3, 2e-2),
        step_per_prefill_token_s=rng.uniform(1e-5, 1e-3),
        step_per_decode_s=rng.uniform(1e-4, 3e-3),
        small_step_rows=small_step_rows,
        small_step_base_s=rng.uniform(1e-3, 2e-2),
        small_step_per_row_s=rng.uniform(1e-4, 3e-3),
        queue=tuple(queue),
        num_running=sum(w.running for w in queue),
        num_waiting=sum(not w.running for w in queue),
    )
    return view, RouteInput(prompt_tokens=prompt, max_new_tokens=rng.randint(1, 12))


SCENARIOS = [random_scenario(random.Random(seed)) for seed in range(200)]


def mismatches() -> list[tuple[WorkerView, RouteInput, float, float]]:
    found = []
    for view, request in SCENARIOS:
        predicted = finish_time_score(view, request).score
        simulated = simulate_finish_time(view, request)
        if predicted != pytest.approx(simulated, rel=1e-9, abs=0):
            found.append((view, request, predicted, simulated))
    return found


def test_simulation_reproduces_the_hand_computations():
    request = RouteInput(prompt_tokens=100, max_new_tokens=5)
    assert simulate_finish_time(step_view(), request) == pytest.approx(
        4 * BASE + 100 * PER_PREFILL + 4 * (BASE + PER_DECODE), rel=1e-12
    )


def test_scenarios_exercise_waiting_for_slots_and_mixed_steps():
    assert sum(v.num_running == v.report.max_active_requests and v.num_waiting > 0 for v, _ in SCENARIOS) >= 20
    assert sum(v.report.max_prefill_step_tokens > v.report.max_num_batched_tokens for v, _ in SCENARIOS) >= 20
    assert sum(any(w.running and w.prefill_tokens > 0 for w in v.queue) for v, _ in SCENARIOS) >= 20
    assert sum(v.cached_tokens > 0 for v, _ in SCENARIOS) >= 20
    assert sum(v.report.small_step_rows > 0 for v, _ in SCENARIOS) >= 20


def test_finish_time_agrees_with_step_by_step_simulation():
    found = mismatches()
    assert not found, f"{len(found)} of {len(SCENARIOS)} disagree, e.g. {found[0]}"


def test_finish_time_counts_decodes_against_the_step_budget():
    # One request decoding, a chunk limit of 8, a new 16-token prompt. The worker schedules
    # [decode + 7], [decode + 7], [decode + 2 (samples)], then two steps of two decodes.
    view = step_view(
        max_num_batched_tokens=8, max_active_requests=4, queue=(QueuedWork(True, 0, 10),), num_running=1
    )
    request = RouteInput(prompt_tokens=16, max_new_tokens=3)
    expected = 3 * (BASE + PER_DECODE) + 16 * PER_PREFILL + 2 * (BASE + 2 * PER_DECODE)
    assert simulate_finish_time(view, request) == pytest.approx(expected, rel=1e-12)
    assert finish_time_score(view, request).score == pytest.approx(expected, rel=1e-12)


# --- KV capacity and eviction -----------------------------------------------------------------------------

KV = dict(block_size=16, kv_blocks_total=100, kv_blocks_used=0)


def test_a_hit_that_the_queue_ahead_evicts_first_is_no_hit():
    # every free block caches something: the waiting request's 160 new prompt tokens and 16 output
    # tokens (11 blocks) evict 176 of the prompt's 320 evictable cached tokens
    waiting = (QueuedWork(False, 160, 16),)
    full = make_view(queue=waiting, cached_tokens=320, cached_evictable_tokens=320, kv_blocks_cached=100, **KV)
    request = RouteInput(prompt_tokens=330, max_new_tokens=1)
    assert play_evictions(full, request) == Evictions((160,), 320 - 176)
    held = make_view(queue=waiting, cached_tokens=320, cached_evictable_tokens=0, kv_blocks_cached=100, **KV)
    assert play_evictions(held, request).cached_tokens == 320  # blocks a running request holds stay
    roomy = make_view(queue=waiting, cached_tokens=320, cached_evictable_tokens=320, kv_blocks_cached=50, **KV)
    assert play_evictions(roomy, request).cached_tokens == 320  # 50 uncaching free blocks cover the 11
    unknown = make_view(queue=waiting, cached_tokens=320, cached_evictable_tokens=320)
    assert play_evictions(unknown, request).cached_tokens == 320  # no KV report: no eviction counted
    assert cost_score(full, request).prefill_s == pytest.approx((160 + 330 - 144) / 1000)


def test_evictions_cascade_down_the_queue():
    # the first waiting request's 33 blocks evict the second's hit; its prefill grows by that
    queue = (QueuedWork(False, 512, 16), QueuedWork(False, 16, 16, cached_tokens=496))
    view = make_view(queue=queue, kv_blocks_cached=100, **KV)
    assert play_evictions(view, RouteInput(prompt_tokens=8, max_new_tokens=1)).prefill_tokens == (512, 16 + 496)


def test_finish_time_waits_for_kv_capacity_not_only_for_a_slot():
    steps = dict(step_base_s=0.01, step_per_prefill_token_s=1e-4, step_per_decode_s=1e-4, max_num_batched_tokens=64,
                 max_active_requests=4, block_size=16)
    running = (QueuedWork(True, 0, 10),)
    request = RouteInput(prompt_tokens=32, max_new_tokens=4)  # 3 blocks with its output
    room = finish_time_score(make_view(queue=running, kv_blocks_total=100, kv_blocks_used=8, **steps), request).score
    tight = finish_time_score(make_view(queue=running, kv_blocks_total=10, kv_blocks_used=8, **steps), request).score
    decode = 0.01 + 1e-4
    assert room == pytest.approx((0.01 + 32e-4 + 1e-4) + 3 * (0.01 + 2e-4))  # prefilled beside the running one
    assert tight == pytest.approx(10 * decode + (0.01 + 32e-4) + 3 * decode)  # after it frees its 8 blocks
