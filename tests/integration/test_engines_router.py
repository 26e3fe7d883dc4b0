"""The router over a Tandem-engine CPU worker and a vLLM-engine GPU worker (both on the CPU here)."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.engine.helpers import hf_greedy
from tests.integration.engines import BLOCK_SIZE, LONG_OUTPUT, running_engine_worker
from tests.integration.test_reliability import assert_no_leaks
from tests.integration.workers import (HARNESS, RouterProcess, WorkerProcess, healthy, occupy, seen_by_router,
                                      serving_router, stalled, wait_for, wait_until,
                                      worker_state)

GREEDY = common_pb2.SamplingParams(temperature=0)


def route(prompt, max_new_tokens=4, **fields) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=max_new_tokens,
                                   sampling=GREEDY, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def mixed_stack(tiny_llama_64, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mixed")
    # One request at a time on the CPU worker, so that a burst queues there and finish_time offloads.
    with running_engine_worker("tandem", tiny_llama_64, logs / "cpu.log", "--max-active", "1") as cpu, \
            running_engine_worker("vllm", tiny_llama_64, logs / "gpu.log", kind="gpu") as gpu:
        router = RouterProcess(tiny_llama_64, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"])
        with serving_router(router, {"cpu", "gpu"}):
            yield router


def test_the_routers_lookup_in_a_vllm_workers_index_matches_vllms_own_cache_hits(mixed_stack):
    router = mixed_stack
    rng = random.Random(7)
    prefixes = [[rng.randrange(400) for _ in range(rng.randrange(40, 140))] for _ in range(4)]
    matches, total = 0, 100
    for _ in range(total):
        prompt = rng.choice(prefixes) + [rng.randrange(400) for _ in range(rng.randrange(1, 40))]
        responses = list(router.stub.Generate(route(prompt, policy="gpu_only"), timeout=60))
        decision = responses[0].decision
        assert decision.chosen_worker == "gpu"
        looked_up = next(s for s in decision.scores if s.worker == "gpu")
        assert looked_up.state_source == "index"
        matches += looked_up.cached_tokens == responses[-1].result.usage.cached_tokens
        time.sleep(0.05)  # vLLM publishes a step's KV events just after the step's output
    assert matches >= 0.99 * total, f"{matches} of {total} lookups matched vLLM's num_cached_tokens"


def test_finish_time_offloads_a_burst_from_the_queued_tandem_worker_to_the_vllm_worker(mixed_stack):
    router = mixed_stack
    prompts = [[(17 * i + j) % 400 for j in range(24)] for i in range(16)]

    def run(prompt):
        responses = list(router.stub.Generate(route(prompt, max_new_tokens=64, policy="finish_time"), timeout=120))
        return responses[0].decision.chosen_worker, responses[-1].result

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    assert Counter(worker for worker, _ in results).keys() == {"cpu", "gpu"}
    for _, result in results:  # tokens: test_engines.py compares each engine with transformers one stream at a time
        assert (result.finish_reason, result.usage.output_tokens) == (common_pb2.FINISH_REASON_LENGTH, 64)


def test_list_backends_names_each_workers_engine(mixed_stack):
    backends = {b.name: b for b in mixed_stack.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends}
    assert (backends["cpu"].state.engine, backends["gpu"].state.engine) == ("tandem", "vllm")



@pytest.fixture(scope="module")
def replacing_stack(tiny_llama_64, tmp_path_factory):
    """A Tandem worker (50 ms steps) and a vLLM worker, one request at a time each, behind a router that checks
    every 0.2 s whether a waiting request would finish sooner elsewhere: (router, workers)."""
    logs = tmp_path_factory.mktemp("replacing")
    tandem = WorkerProcess(tiny_llama_64, logs / "cpu.log", "--block-size", str(BLOCK_SIZE), "--max-active", "1",
                           launcher=HARNESS, env={"HARNESS_STEP_DELAY_S": "0.05"})
    with healthy(tandem) as cpu, running_engine_worker("vllm", tiny_llama_64, logs / "gpu.log", "--max-active", "1",
                                                       kind="gpu") as gpu:
        router = RouterProcess(tiny_llama_64, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"],
                               "--replace-interval-s", "0.2")
        with serving_router(router, {"cpu", "gpu"}):
            yield router, {"cpu": cpu, "gpu": gpu}


def request_ids(worker) -> set[str]:
    return {load.request_id for load in worker_state(worker).requests}


def moved_once(router, tiny_llama_64, request_id: str, source: str, target: str, free_target) -> None:
    """Route a request that must first wait on ``source``; ``free_target()`` then frees the target. The request
    moves there once and completes there, token for token."""
    prompt = list(range(40, 70))
    stream = router.stub.Generate(route(prompt, max_new_tokens=8, request_id=request_id), timeout=120)
    assert next(stream).decision.chosen_worker == source
    free_target()
    responses = list(stream)
    decisions = [r.decision for r in responses if r.HasField("decision")]
    assert [(d.chosen_worker, list(d.moved_from)) for d in decisions] == [(target, [source])]
    token_responses = [r for r in responses if r.token_ids]
    assert [t for r in token_responses for t in r.token_ids] == hf_greedy(tiny_llama_64, prompt, 8)
    assert {r.worker for r in token_responses} == {target}
    assert responses[-1].result.usage.output_tokens == 8


# vLLM decodes the tiny model at about 1 ms a token, faster than any blocker could last, so its engine core is
# stalled (SIGSTOP) for as long as its queue must stand still.

@contextlib.contextmanager
def blocking(worker, request_id: str, max_new_tokens: int):
    """A blocker on ``worker`` (see ``occupy``), cancelled when the block ends however it ends."""
    call = occupy(worker, request_id, max_new_tokens)
    try:
        yield call
    finally:
        call.cancel()


@contextlib.contextmanager
def running_vllm_blocker(worker, stall):
    """A blocker that vLLM runs with most of its tokens left, its engine core stopped: stepped until vLLM runs
    it. A loaded machine can hold one step open long enough for vLLM to decode the blocker to its end; it is
    then sent again."""

    def running_or_spent():
        loads = worker_state(worker).requests
        return "spent" if not loads else loads[0] if loads[0].running else None

    seen = []
    for attempt in range(3):
        with blocking(worker, f"vllm-blocker-{attempt}", LONG_OUTPUT):
            wait_until(lambda: worker_state(worker).requests)
            blocker = stall.step_until(running_or_spent)
            seen.append(blocker if blocker == "spent" else (blocker.request_id, blocker.decode_tokens))
            if blocker != "spent" and blocker.decode_tokens > LONG_OUTPUT // 2:
                yield
                return
    raise AssertionError(f"vLLM decoded each blocker too far before its engine core stopped: {seen}")


def test_a_request_waiting_on_the_vllm_worker_moves_to_the_freed_tandem_worker(replacing_stack, tiny_llama_64):
    router, workers = replacing_stack
    # The Tandem blocker's 6000 steps of 50 ms outlast the vLLM blocker's on any machine, so the request first
    # waits on vLLM.
    with blocking(workers["cpu"], "tandem-blocker-1", LONG_OUTPUT) as tandem_blocker, stalled(workers["gpu"]) as stall, \
            running_vllm_blocker(workers["gpu"], stall):
        wait_for(lambda: seen_by_router(router), {"cpu": (1, 0), "gpu": (1, 0)}, 30)
        moved_once(router, tiny_llama_64, "to-tandem", "gpu", "cpu", tandem_blocker.cancel)
        assert "to-tandem" not in request_ids(workers["gpu"])  # withdrawn: aborted in vLLM
    assert_no_leaks(router, workers)


def test_a_request_waiting_on_the_tandem_worker_moves_to_the_freed_vllm_worker(replacing_stack, tiny_llama_64):
    router, workers = replacing_stack
    with blocking(workers["cpu"], "tandem-blocker-2", 400), contextlib.ExitStack() as stall:  # 20 s
        stall.enter_context(stalled(workers["gpu"]))
        vllm_blockers = [stall.enter_context(blocking(workers["gpu"], f"vllm-blocker-{i}", LONG_OUTPUT))
                         for i in range(12)]
        wait_for(lambda: seen_by_router(router), {"cpu": (1, 0), "gpu": (0, 12)}, 30)

        def free_vllm():
            for call in vllm_blockers:
                call.cancel()
            wait_until(lambda: not request_ids(workers["gpu"]))
            stall.close()

        moved_once(router, tiny_llama_64, "to-vllm", "cpu", "gpu", free_vllm)
        assert "to-vllm" not in request_ids(workers["cpu"])  # withdrawn: aborted in Tandem's engine
    assert_no_leaks(router, workers)
