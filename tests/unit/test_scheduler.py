"""Unit tests for the continuous-batching scheduler, driven by simulated model steps."""

from __future__ import annotations

import random

import pytest

from tandem.engine.config import SchedulerConfig
from tandem.errors import QueueFullError
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.sampling import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks: int = 64, **limits) -> Scheduler:
    config = {"max_active_requests": 4, "max_waiting_requests": 16, "max_num_batched_tokens": 16, "block_size": BLOCK}
    config.update(limits)
    config.setdefault("max_prefill_step_tokens", config["max_num_batched_tokens"])  # one budget unless a test sets two
    return Scheduler(SchedulerConfig(**config), num_blocks)


def make_request(req_id: str, prompt, max_new_tokens: int = 4) -> Request:
    return Request(req_id, list(prompt), max_new_tokens)


def next_token(request: Request) -> int:
    """The token the 'model' samples: a function of the position only, so recomputation agrees."""
    return 1000 + request.num_tokens


def step_sampling(scheduler: Scheduler) -> tuple[SchedulerOutput, list[bool]]:
    """One simulated model step; requests that reach ``max_new_tokens`` are finished.

    Also returns each item's ``samples`` flag.
    """
    output = scheduler.schedule()
    samples = [item.samples for item in output.scheduled]
    sampled = [next_token(item.request) if flag else None for item, flag in zip(output.scheduled, samples)]
    for request in scheduler.update_from_output(output, sampled):
        if request.num_output_tokens >= request.max_new_tokens:
            scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    return output, samples


def step(scheduler: Scheduler) -> SchedulerOutput:
    return step_sampling(scheduler)[0]


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_work():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(step(scheduler))
    return outputs


def plan(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(item.request.req_id, item.start, item.num_new_tokens) for item in output.scheduled]


def expected_output(prompt, max_new_tokens: int) -> list[int]:
    return [1000 + len(prompt) + i for i in range(max_new_tokens)]


# --- admission ---------------------------------------------------------------------------------


def test_requests_are_admitted_first_come_first_served():
    scheduler = make_scheduler(max_active_requests=2)
    a, b, c = (make_request(name, range(10 * i, 10 * i + 3), max_new_tokens=2) for i, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)

    first = step(scheduler)
    assert plan(first) == [("a", 0, 3), ("b", 0, 3)]
    assert first.preempted == []
    assert list(scheduler.waiting) == [c]
    assert c.status is RequestStatus.WAITING

    step(scheduler)  # a and b sample their second token and finish
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert plan(step(scheduler)) == [("c", 0, 3)]


def test_admission_does_not_skip_a_head_request_that_does_not_fit():
    scheduler = make_scheduler(num_blocks=4)
    holder = make_request("holder", range(8), max_new_tokens=2)  # 2 blocks, then a 3rd
    scheduler.add_request(holder)
    step(scheduler)
    big = make_request("big", range(100, 112))  # needs 3 blocks, only 1 free
    small = make_request("small", range(200, 203))  # would fit in 1 block
    scheduler.add_request(big)
    scheduler.add_request(small)

    output = step(scheduler)
    assert plan(output) == [("holder", 8, 1)]
    assert list(scheduler.waiting) == [big, small]

    assert holder.status is RequestStatus.FINISHED_LENGTH  # its blocks are free again
    assert plan(step(scheduler)) == [("big", 0, 12), ("small", 0, 3)]


def test_max_active_requests_is_respected():
    scheduler = make_scheduler(max_active_requests=2, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", range(10 * i, 10 * i + 5), max_new_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)

    outputs = run_to_completion(scheduler)
    for output in outputs:
        assert len(output.scheduled) <= 2
    assert max(len(o.scheduled) for o in outputs) == 2
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)


def test_waiting_queue_is_bounded():
    scheduler = make_scheduler(max_waiting_requests=2, max_active_requests=1)
    scheduler.add_request(make_request("a", [1, 2]))
    scheduler.add_request(make_request("b", [3, 4]))
    rejected = make_request("c", [5, 6])
    with pytest.raises(QueueFullError):
        scheduler.add_request(rejected)
    assert rejected not in scheduler.waiting
    assert scheduler.load().num_waiting == 2

    step(scheduler)  # admits a, freeing a waiting slot
    scheduler.add_request(rejected)
    assert list(scheduler.waiting)[-1] is rejected


# --- token budget and chunked prefill ------------------------------------------------------------


def test_a_long_prompt_alone_is_prefilled_in_chunks_of_the_prefill_step_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4, max_prefill_step_tokens=8)
    request = make_request("long", range(20), max_new_tokens=1)
    scheduler.add_request(request)

    steps = [step_sampling(scheduler) for _ in range(3)]
    assert [plan(output) for output, _ in steps] == [[("long", 0, 8)], [("long", 8, 8)], [("long", 16, 4)]]
    assert [samples for _, samples in steps] == [[False], [False], [True]]
    assert request.num_output_tokens == 1
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_requests_after_the_first_share_the_usual_budget_so_a_burst_waits_for_its_shared_prefix():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_prefill_step_tokens=64)
    prefix = list(range(12))
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", prefix + [100 + index, 200 + index], max_new_tokens=2))

    assert plan(step(scheduler)) == [("r0", 0, 14)]  # alone, past the usual budget; the others wait
    # r0 now decodes: the step takes the usual budget, and the others find the prefix r0 cached
    assert plan(step(scheduler)) == [("r0", 14, 1), ("r1", 12, 2), ("r2", 12, 2)]


def test_a_prompt_whose_logprobs_are_asked_for_runs_in_chunks_of_the_usual_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4, max_prefill_step_tokens=8)
    scheduler.add_request(Request("wanting", list(range(10)), 1, SamplingParams(prompt_logprobs=1)))

    assert [plan(step(scheduler)) for _ in range(3)] == [[("wanting", 0, 4)], [("wanting", 4, 4)],
                                                         [("wanting", 8, 2)]]


def test_chunked_prefill_shares_each_step_with_running_decodes():
    budget = 8
    scheduler = make_scheduler(max_num_batched_tokens=budget, max_prefill_step_tokens=64)
    decoder = make_request("decoder", [1, 2], max_new_tokens=20)
    scheduler.add_request(decoder)
    step(scheduler)
    assert decoder.num_output_tokens == 1

    long = make_request("long", range(100, 130), max_new_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        output, samples = step_sampling(scheduler)
        assert sum(item.num_new_tokens for item in output.scheduled) <= budget
        by_id = {item.request.req_id: item for item in output.scheduled}
        assert by_id["decoder"].num_new_tokens == 1, "the running decode must be scheduled every step"
        assert samples[output.scheduled.index(by_id["decoder"])]
        chunks.append((by_id["long"].start, by_id["long"].num_new_tokens))
        assert output.num_decode_requests == 1
        assert output.num_prefill_tokens == by_id["long"].num_new_tokens
    assert chunks == [(0, 7), (7, 7), (14, 7), (21, 7), (28, 2)]
    assert decoder.num_output_tokens == 1 + len(chunks)


def test_step_token_budget_holds_under_mixed_load():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_prefill_step_tokens=25, max_active_requests=3)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", range(50 * i, 50 * i + 12 + 3 * i), max_new_tokens=4))
    firsts = []
    for output in run_to_completion(scheduler):
        first, total = output.scheduled[0].num_new_tokens, sum(item.num_new_tokens for item in output.scheduled)
        assert 0 < first <= (10 if output.num_decode_requests else 25)
        assert total <= max(first, 10)  # the rest share what the first left of the usual budget
        firsts.append(first)
    assert max(firsts) > 10  # a prompt alone took a longer chunk


# --- prefix cache --------------------------------------------------------------------------------


def test_admission_reuses_cached_prefix():
    scheduler = make_scheduler()
    first = make_request("first", range(12), max_new_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)

    second = make_request("second", list(range(8)) + [90, 91, 92])
    reported = scheduler.pool.cached_prefix(second.token_ids).tokens
    assert reported == 8
    scheduler.add_request(second)
    output = step(scheduler)
    assert plan(output) == [("second", 8, 3)]
    assert second.num_cached_tokens == reported
    assert scheduler.load().prefix_hit_tokens == 8
    assert scheduler.load().prefix_queried_tokens == 12 + 11


def test_identical_prompt_still_computes_at_least_one_token():
    scheduler = make_scheduler()
    prompt = list(range(8))
    scheduler.add_request(make_request("first", prompt, max_new_tokens=1))
    run_to_completion(scheduler)

    again = make_request("again", prompt, max_new_tokens=1)
    assert scheduler.pool.cached_prefix(prompt).tokens == 4
    scheduler.add_request(again)
    output, samples = step_sampling(scheduler)
    [item] = output.scheduled
    assert again.num_cached_tokens == 4
    assert item.start == 4
    assert item.num_new_tokens >= 1
    assert samples == [True]
    assert again.output_token_ids == [1000 + len(prompt)]


def test_running_requests_share_cached_prefix_blocks():
    scheduler = make_scheduler()
    prefix = list(range(8))
    a = make_request("a", prefix + [50], max_new_tokens=3)
    scheduler.add_request(a)
    step(scheduler)
    b = make_request("b", prefix + [60], max_new_tokens=3)
    scheduler.add_request(b)
    step(scheduler)
    assert b.num_cached_tokens == 8
    assert a.block_ids[:2] == b.block_ids[:2]
    assert all(scheduler.pool.blocks[i].ref_count == 2 for i in a.block_ids[:2])
    run_to_completion(scheduler)
    assert scheduler.pool.num_used_blocks == 0


# --- preemption ----------------------------------------------------------------------------------


def test_most_recently_admitted_request_is_preempted_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=7, block_size=2, max_active_requests=3, max_num_batched_tokens=12)
    prompts = {name: list(range(10 * i, 10 * i + 4)) for i, name in enumerate("abc")}
    a, b, c = (make_request(name, prompts[name], max_new_tokens=2) for name in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)  # each holds 2 blocks, one block left, each now has 5 tokens
    assert scheduler.pool.num_free_blocks == 1
    late = make_request("late", [70, 71], max_new_tokens=1)
    scheduler.add_request(late)

    output = step(scheduler)  # a and b both need a third block
    assert output.preempted == [c]
    assert plan(output) == [("a", 4, 1), ("b", 4, 1)]
    assert c.status is RequestStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.block_ids == []
    assert c.num_preemptions == 1
    assert c.output_token_ids == [1000 + 4], "a preempted request keeps the tokens it already generated"
    assert list(scheduler.waiting) == [c, late]
    assert a.num_preemptions == b.num_preemptions == 0
    # c's prefix was published before it was preempted; b's new block then evicted c's second block.
    assert c.num_cached_estimate == 2
    assert scheduler.load().waiting_prefill_tokens == (5 - 2) + 2

    cached_before = scheduler.pool.cached_prefix(c.token_ids).tokens
    num_tokens = c.num_tokens
    output, samples = step_sampling(scheduler)
    assert output.scheduled[0].request is c
    assert c.num_cached_tokens == cached_before
    assert output.scheduled[0].start == cached_before
    assert output.scheduled[0].start + output.scheduled[0].num_new_tokens == num_tokens
    assert samples[0]

    run_to_completion(scheduler)
    for name, request in zip("abc", (a, b, c)):
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == expected_output(prompts[name], 2)
    assert late.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.pool.num_used_blocks == 0


def test_preempted_victim_releases_blocks_to_the_older_request():
    scheduler = make_scheduler(num_blocks=3, block_size=2, max_active_requests=2)
    a = make_request("a", [1, 2, 3, 4], max_new_tokens=2)  # grows to a 3rd block
    b = make_request("b", [5, 6], max_new_tokens=3)  # grows to a 2nd block
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # a: 2 blocks, b: 1 block, none free
    output = step(scheduler)
    assert output.preempted == [b]
    assert plan(output) == [("a", 4, 1)]
    run_to_completion(scheduler)
    assert a.output_token_ids == expected_output([1, 2, 3, 4], 2)
    assert b.output_token_ids == expected_output([5, 6], 3)
    assert scheduler.pool.num_used_blocks == 0


def test_newest_request_preempts_itself_when_it_cannot_grow():
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_active_requests=2)
    a = make_request("a", [1, 2, 3], max_new_tokens=3)  # its second block still has room
    b = make_request("b", [5, 6, 7, 8], max_new_tokens=2)  # needs a third block to decode
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    assert scheduler.pool.num_free_blocks == 0

    output = step(scheduler)
    assert output.preempted == [b]
    assert plan(output) == [("a", 3, 1)]
    assert list(scheduler.waiting) == [b]
    assert b.num_computed_tokens == 0
    run_to_completion(scheduler)
    assert a.output_token_ids == expected_output([1, 2, 3], 3)
    assert b.output_token_ids == expected_output([5, 6, 7, 8], 2)
    assert scheduler.pool.num_used_blocks == 0


# --- finishing -----------------------------------------------------------------------------------


def test_finish_releases_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(num_blocks=8, block_size=2, max_active_requests=3, max_num_batched_tokens=12)
    requests = [make_request(f"r{i}", range(10 * i, 10 * i + 4), max_new_tokens=8) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(3):
        step(scheduler)
    running = list(scheduler.running)
    waiting = list(scheduler.waiting)
    assert running and waiting
    assert any(r.num_preemptions for r in waiting), "the setup should leave a preempted request waiting"
    assert scheduler.pool.num_used_blocks > 0

    scheduler.finish(waiting[0], RequestStatus.FINISHED_ABORTED)
    scheduler.finish(running[0], RequestStatus.FINISHED_ABORTED)
    assert waiting[0] not in scheduler.waiting
    assert running[0] not in scheduler.running
    assert running[0].block_ids == []
    run_to_completion(scheduler)

    assert scheduler.pool.num_used_blocks == 0
    assert scheduler.pool.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in scheduler.pool.blocks)
    assert {r.status for r in requests} <= {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_LENGTH}
    assert sum(r.status is RequestStatus.FINISHED_ABORTED for r in requests) == 2
    load = scheduler.load()
    assert (load.num_running, load.num_waiting, load.waiting_prefill_tokens) == (0, 0, 0)


def test_finish_is_idempotent_and_keeps_the_first_status():
    scheduler = make_scheduler()
    request = make_request("a", range(6))
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish(request, RequestStatus.FINISHED_STOP)
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert request.status is RequestStatus.FINISHED_STOP
    assert scheduler.pool.num_used_blocks == 0
    assert not scheduler.has_work()


def test_update_skips_a_request_finished_during_the_step():
    scheduler = make_scheduler()
    a = make_request("a", range(5))
    b = make_request("b", range(10, 15))
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    updated = scheduler.update_from_output(output, [7, 8])
    assert updated == [b]
    assert a.token_ids == list(range(5))
    assert b.token_ids == list(range(10, 15)) + [8]
    assert scheduler.pool.num_used_blocks == len(b.block_ids)


def test_update_finishes_what_check_stop_ends_and_stamps_first_tokens_from_the_clock():
    now = [10.0]
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK), 64, clock=lambda: now[0])
    a = make_request("a", range(5))
    b = make_request("b", range(10, 15))
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    now[0] = 12.5
    updated = scheduler.update_from_output(
        output, [7, 8], lambda request: RequestStatus.FINISHED_STOP if request is a else None
    )
    assert updated == [a, b]
    assert a.status is RequestStatus.FINISHED_STOP and a.block_ids == []
    assert b.status is RequestStatus.RUNNING
    assert a.first_scheduled_time == b.first_scheduled_time == 10.0
    assert a.first_token_time == b.first_token_time == 12.5
    assert list(scheduler.running) == [b]

    now[0] = 20.0
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, [9], lambda request: None) == [b]
    assert b.first_token_time == 12.5


# --- load ----------------------------------------------------------------------------------------


def test_load_reports_running_and_waiting_work():
    scheduler = make_scheduler(max_active_requests=2, max_num_batched_tokens=8)
    a = make_request("a", [1, 2, 3], max_new_tokens=6)
    scheduler.add_request(a)
    step(scheduler)  # a: prompt done, 1 output
    b = make_request("b", range(100, 120), max_new_tokens=5)
    scheduler.add_request(b)
    step(scheduler)  # a decodes (2 outputs), b prefills 7 tokens (block 0 published)

    c = make_request("c", list(range(100, 104)) + [7] * 6, max_new_tokens=3)  # first block of b cached
    d = make_request("d", [9] * 5, max_new_tokens=2)
    scheduler.add_request(c)
    scheduler.add_request(d)

    load = scheduler.load()
    assert (load.num_running, load.num_waiting) == (2, 2)
    assert load.running_prefill_tokens == 0 + (20 - 7)
    assert load.running_decode_budget == (6 - 2) + 5
    assert c.num_cached_estimate == 4
    assert [(r.req_id, r.cached_tokens) for r in load.requests] == [("a", 0), ("b", 0), ("c", 4), ("d", 0)]
    assert load.waiting_prefill_tokens == (10 - 4) + 5
    assert load.waiting_decode_budget == 3 + 2
    assert load.num_kv_blocks == 64
    assert load.num_used_blocks == scheduler.pool.num_used_blocks == len(a.block_ids) + len(b.block_ids)
    assert load.prefix_queried_tokens == 3 + 20
    assert load.prefix_hit_tokens == 0


def test_waiting_estimate_shrinks_when_counted_blocks_are_evicted():
    scheduler = make_scheduler(num_blocks=6, max_active_requests=1, max_num_batched_tokens=4)
    prefix = list(range(8))
    warm = make_request("warm", prefix + [8], max_new_tokens=1)
    scheduler.add_request(warm)
    run_to_completion(scheduler)
    assert scheduler.pool.num_cached_free_blocks == 2

    filler = make_request("filler", range(100, 124), max_new_tokens=1)  # 6 blocks, one per step
    scheduler.add_request(filler)
    step(scheduler)
    waiter = make_request("waiter", prefix + [50], max_new_tokens=2)
    scheduler.add_request(waiter)
    assert scheduler.load().waiting_prefill_tokens == 9 - 8

    observed = []
    while filler.num_output_tokens == 0:
        step(scheduler)
        observed.append((scheduler.load().waiting_prefill_tokens, scheduler.pool.cached_prefix(waiter.token_ids).tokens))
    # Blocks are evicted tail first: the second prefix block goes, then the first.
    assert [prefill for prefill, _ in observed] == [1, 1, 1, 5, 9]
    assert [cached for _, cached in observed] == [8, 8, 8, 4, 0]

    run_to_completion(scheduler)
    assert waiter.num_cached_tokens == 0
    assert waiter.status is RequestStatus.FINISHED_LENGTH


def test_estimate_of_a_finished_waiting_request_is_dropped():
    scheduler = make_scheduler(num_blocks=4, max_active_requests=1, max_num_batched_tokens=4)
    scheduler.add_request(make_request("warm", range(9), max_new_tokens=1))
    run_to_completion(scheduler)
    filler = make_request("filler", range(100, 116), max_new_tokens=1)
    scheduler.add_request(filler)
    step(scheduler)
    waiter = make_request("waiter", list(range(8)) + [50])
    scheduler.add_request(waiter)
    assert waiter.num_cached_estimate == 8
    scheduler.finish(waiter, RequestStatus.FINISHED_ABORTED)
    run_to_completion(scheduler)  # evicts the blocks the aborted request had counted on
    assert waiter.num_cached_estimate == 8
    assert scheduler.load().waiting_prefill_tokens == 0


# --- randomized invariants -----------------------------------------------------------------------


class KVModel:
    """Stands in for the KV cache contents: which token each (block, slot) holds."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, output: SchedulerOutput) -> None:
        size = self.scheduler.block_size
        pool = self.scheduler.pool
        for item in output.scheduled:
            request = item.request
            end = item.start + item.num_new_tokens
            assert len(request.block_ids) * size >= end
            for pos in range(item.start):
                slot = (request.block_ids[pos // size], pos % size)
                assert self.slots.get(slot) == request.token_ids[pos], f"{request.req_id}: stale KV at {pos}"
        written = set()
        for item in output.scheduled:
            request = item.request
            for pos in range(item.start, item.start + item.num_new_tokens):
                block_id = request.block_ids[pos // size]
                assert pool.blocks[block_id].ref_count == 1, "writing into a shared block"
                assert pool.blocks[block_id].block_hash is None, "writing into a published block"
                slot = (block_id, pos % size)
                assert slot not in written
                written.add(slot)
                self.slots[slot] = request.token_ids[pos]


def check_invariants(scheduler: Scheduler) -> None:
    pool = scheduler.pool
    holders = [0] * pool.num_blocks
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert len(set(request.block_ids)) == len(request.block_ids)
        for block_id in request.block_ids:
            holders[block_id] += 1
    assert [block.ref_count for block in pool.blocks] == holders
    assert pool.num_used_blocks == sum(1 for count in holders if count)
    assert len(scheduler.running) <= scheduler.config.max_active_requests
    for request in scheduler.waiting:
        assert request.status is RequestStatus.WAITING
        assert request.block_ids == []
        assert request.num_cached_estimate <= pool.cached_prefix(request.token_ids).tokens


def test_randomized_workload_keeps_invariants():
    rng = random.Random(1234)
    config = SchedulerConfig(max_active_requests=4, max_waiting_requests=64, max_num_batched_tokens=10,
                             max_prefill_step_tokens=14, block_size=BLOCK)
    scheduler = Scheduler(config, 12)
    kv = KVModel(scheduler)
    prefixes = [list(range(1, 9)), list(range(20, 32)), list(range(40, 44))]
    pending = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(100, 200) for _ in range(rng.randrange(0, 8))]
        pending.append(make_request(f"r{i}", prompt, max_new_tokens=rng.randrange(1, 7)))
    requests = list(pending)
    aborted = set()

    num_steps = 0
    while pending or scheduler.has_work():
        num_steps += 1
        assert num_steps < 2000, "scheduler made no progress"
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if rng.random() < 0.05 and scheduler.has_work():
            victim = rng.choice(list(scheduler.waiting) + scheduler.running)
            scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.req_id)
        decoding = any(request.prefill_remaining == 0 for request in scheduler.running)
        output = scheduler.schedule()
        if output.scheduled:
            first = output.scheduled[0].num_new_tokens
            assert first <= (10 if decoding else 14)
            assert sum(item.num_new_tokens for item in output.scheduled) <= max(first, 10)
        kv.execute(output)
        if rng.random() < 0.03 and output.scheduled:
            victim = rng.choice(output.scheduled).request  # aborted while its step runs
            scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim.req_id)
        sampled = [next_token(item.request) if item.samples else None for item in output.scheduled]
        for request in scheduler.update_from_output(output, sampled):
            if request.num_output_tokens >= request.max_new_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        check_invariants(scheduler)

    assert scheduler.pool.num_used_blocks == 0
    for request in requests:
        if request.req_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
        else:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == expected_output(request.prompt_token_ids, request.max_new_tokens)
    # The workload is meant to exercise these paths; fail loudly if it stops doing so.
    assert any(r.num_preemptions for r in requests)
    assert any(r.num_cached_tokens for r in requests)
    assert aborted
