"""Re-placement before the first token, end to end: a request waiting on one real worker is withdrawn
when the other frees up, routed there, and completes exactly once; and the check asks each worker once
per round, however many requests wait."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from tandem.launch import free_port
from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.engine.helpers import hf_greedy
from tests.integration.test_reliability import assert_no_leaks
from tests.integration.workers import (HARNESS, SERVING, RouterProcess, WorkerProcess, drained, occupy, scrape_metrics,
                                      seen_by_router, wait_until, worker_load)

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(temperature=0.0)


@contextlib.contextmanager
def _two_workers_behind_a_router(model_dir, tmp_path, metrics: str):
    """Workers a and b (one slot each, 50 ms steps) behind a router checking every 0.2 s: (router, workers).
    ``metrics``: which serve /metrics, "router" or "workers"."""
    router_args = ("--metrics-port", str(free_port())) if metrics == "router" else ()
    workers = {name: WorkerProcess(model_dir, tmp_path / f"{name}.log", "--max-active", "1",
                                   *(("--metrics-port", str(free_port())) if metrics == "workers" else ()),
                                   launcher=HARNESS, env={"HARNESS_STEP_DELAY_S": "0.05"}) for name in ("a", "b")}
    router = None
    try:
        for worker in workers.values():
            worker.wait_for_health()
        router = RouterProcess(model_dir, tmp_path / "router.log", [f"{n}=cpu@{w.address}" for n, w in workers.items()],
                               "--replace-interval-s", "0.2", *router_args)
        router.wait_for_health(SERVING)
        router.wait_for_backends({"a", "b"})
        yield router, workers
    finally:
        for process in (router, *workers.values()):
            if process is not None:
                process.close()


def test_a_waiting_request_moves_to_a_worker_that_frees_up_and_completes_once(tiny_llama, tmp_path):
    with _two_workers_behind_a_router(tiny_llama, tmp_path, metrics="router") as (router, workers):
        blocker_a = occupy(workers["a"], "blocker-a", 200)
        blocker_b = occupy(workers["b"], "blocker-b", 400)
        wait_until(lambda: seen_by_router(router) == {"a": (1, 0), "b": (1, 0)}, 30)

        prompt = list(range(40, 70))
        stream = router.stub.Generate(router_pb2.RouteRequest(
            request_id="moving", prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=8,
            ignore_eos=True, sampling=GREEDY), timeout=120)
        first = next(stream)
        assert first.decision.chosen_worker == "a"  # b's blocker has further to go
        blocker_b.cancel()  # b frees up while the request waits behind a's blocker
        responses = list(stream)

        decisions = [r.decision for r in responses if r.HasField("decision")]
        assert [d.chosen_worker for d in decisions] == ["b"]
        assert list(decisions[0].moved_from) == ["a"] and "b predicts" in decisions[0].move_reason
        token_responses = [r for r in responses if r.token_ids]
        assert [t for r in token_responses for t in r.token_ids] == hf_greedy(tiny_llama, prompt, 8)
        assert {r.worker for r in token_responses} == {"b"}
        assert responses[-1].result.usage.output_tokens == 8

        moves = [json.loads(line.split("tandem.router.decisions: ", 1)[1]) for line in router.log().splitlines()
                 if '"event": "move"' in line]
        assert [(m["request_id"], m["from"], m["to"]) for m in moves] == [("moving", "a", "b")]
        counted = scrape_metrics(router)
        assert counted[("tandem_router_moves_total", (("cause", moves[0]["cause"]), ("from_worker", "a"),
                                                      ("to_worker", "b")))] == 1
        assert worker_load(workers["a"]) == (1, 0)  # only its blocker: the withdrawn request was cancelled there
        blocker_a.cancel()
        assert_no_leaks(router, workers)


def _estimates(worker: WorkerProcess) -> float:
    return scrape_metrics(worker)[("tandem_worker_estimates_total", ())]


def test_neither_routing_nor_the_check_asks_the_workers_however_many_requests_wait(tiny_llama, tmp_path):
    """Both read the workers' prefix indexes and snapshots from WatchState; no Estimate reaches a worker."""
    with _two_workers_behind_a_router(tiny_llama, tmp_path, metrics="workers") as (router, workers):
        streams = []
        blockers = [occupy(worker, f"blocker-{name}", 400) for name, worker in workers.items()]
        wait_until(lambda: seen_by_router(router) == {"a": (1, 0), "b": (1, 0)}, 30)
        before = {name: _estimates(worker) for name, worker in workers.items()}
        for index in range(6):
            stream = router.stub.Generate(router_pb2.RouteRequest(
                request_id=f"waiting-{index}", prompt_token_ids=worker_pb2.TokenIds(ids=list(range(40 + index, 70))),
                max_new_tokens=4, ignore_eos=True, sampling=GREEDY), timeout=120)
            assert {s.state_source for s in next(stream).decision.scores} == {"index"}
            threading.Thread(target=lambda call=stream: [None for _ in drained(call)], daemon=True).start()
            streams.append(stream)
        wait_until(lambda: sum(worker_load(worker)[1] for worker in workers.values()) == 6, 30)
        time.sleep(2.0)  # about 10 rounds of 0.2 s
        assert {name: _estimates(worker) - before[name] for name, worker in workers.items()} == {"a": 0, "b": 0}
        assert sum(worker_load(worker)[1] for worker in workers.values()) == 6  # still waiting, none lost
        for call in (*streams, *blockers):
            call.cancel()
        assert_no_leaks(router, workers)
