"""The router over a Tandem-engine CPU worker and a vLLM-engine GPU worker (both on the CPU here)."""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.integration.engines import running_engine_worker
from tests.integration.workers import SERVING, RouterProcess

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
        try:
            router.wait_for_health(SERVING)
            router.wait_for_backends({"cpu", "gpu"})
            yield router
            assert router.alive, router.log()
        finally:
            router.close()


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

