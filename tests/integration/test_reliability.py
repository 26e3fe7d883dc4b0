"""Reliability guarantees on real processes (127.0.0.1, tiny model), each bounded in count and time:
bounded admission, SIGKILL under load, cancellation storms, deadlines, restarts, a stopped or frozen worker."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.integration.workers import HARNESS, SERVING, RouterProcess, WorkerProcess, stopped, wait_until

pytestmark = pytest.mark.slow


def _request(max_new_tokens: int) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(30, 50))),
                                   max_new_tokens=max_new_tokens, ignore_eos=True,
                                   sampling=common_pb2.SamplingParams(temperature=0.0))


def _outcome(router: RouterProcess, request: router_pb2.RouteRequest, delay_s: float) -> tuple[str, str, float]:
    time.sleep(delay_s)
    start = time.monotonic()
    try:
        responses = list(router.stub.Generate(request, timeout=60))
        return "OK", str(responses[-1].result.usage.output_tokens), time.monotonic() - start
    except grpc.RpcError as exc:
        return exc.code().name, exc.details(), time.monotonic() - start


def test_overload_is_refused_quickly_by_the_bounded_admission_queue(tiny_llama, tmp_path):
    worker = WorkerProcess(tiny_llama, tmp_path / "worker.log", launcher=HARNESS, env={"HARNESS_STEP_DELAY_S": "0.05"})
    router = None
    try:
        worker.wait_for_health()
        router = RouterProcess(tiny_llama, tmp_path / "router.log", [f"w=cpu@{worker.address}"], "--max-inflight", "1",
                               "--max-queued", "1", "--queue-timeout-s", "0.5")
        router.wait_for_health(SERVING)
        router.wait_for_backends({"w"})
        with ThreadPoolExecutor(3) as pool:
            running, waiting, refused = pool.map(lambda args: _outcome(router, *args),
                                                 [(_request(40), 0.0), (_request(4), 0.2), (_request(4), 0.4)])
        assert running[:2] == ("OK", "40")
        assert refused[0] == "RESOURCE_EXHAUSTED" and "at capacity" in refused[1] and refused[2] < 0.3
        assert waiting[0] == "RESOURCE_EXHAUSTED" and "waited 0.5 s" in waiting[1] and 0.45 < waiting[2] < 1.5
        assert _outcome(router, _request(4), 0)[:2] == ("OK", "4")  # every slot came back
    finally:
        for process in (router, worker):
            if process is not None:
                process.close()


@contextlib.contextmanager
def cluster(model, tmp_path, names=("a", "b"), step_delay_s: float = 0.02, router_args=(), worker_env=None):
    """Workers (slowed a little, so requests overlap; ``worker_env`` for more of the harness's settings)
    behind one router; yields (router, workers)."""
    workers = {name: WorkerProcess(model, tmp_path / f"{name}.log", launcher=HARNESS,
                                   env={"HARNESS_STEP_DELAY_S": str(step_delay_s), **(worker_env or {})})
               for name in names}
    router = None
    try:
        for worker in workers.values():
            worker.wait_for_health()
        router = RouterProcess(model, tmp_path / "router.log", [f"{n}=cpu@{w.address}" for n, w in workers.items()],
                               *router_args)
        router.wait_for_health(SERVING)
        router.wait_for_backends(set(names))
        yield router, workers
    finally:
        for process in (router, *workers.values()):
            if process is not None:
                process.close()


def restart(workers: dict, name: str, model, tmp_path, step_delay_s: float = 0.02) -> None:
    """Start worker ``name`` again on its port (after it died or was killed)."""
    old = workers[name]
    old.close()
    workers[name] = WorkerProcess(model, tmp_path / f"{name}-{time.monotonic_ns()}.log", launcher=HARNESS,
                                  env={"HARNESS_STEP_DELAY_S": str(step_delay_s)}, port=old.port)
    workers[name].wait_for_health()


def assert_no_leaks(router: RouterProcess, workers: dict, timeout: float = 30.0) -> None:
    """Every worker back to 0 running, 0 waiting and no KV block held; the router holds no credit."""
    def idle(worker):
        state = worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=[5]), timeout=5)
        return (state.num_running, state.num_waiting, state.kv_blocks_used) == (0, 0, 0)

    wait_until(lambda: all(idle(w) for w in workers.values()), timeout)
    backends = router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends
    wait_until(lambda: all(b.inflight_requests == 0 for b in
                           router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends), timeout)
    assert len(backends) == len(workers)


def _stream(router, request, timeout=60.0, cancel_after: int | None = None) -> tuple[str, int, str]:
    """(status, tokens received, details) of one streamed request; ``cancel_after`` tokens ends it early."""
    call = router.stub.Generate(request, timeout=timeout)
    tokens = 0
    try:
        for response in call:
            tokens += len(response.token_ids)
            if cancel_after is not None and tokens >= cancel_after:
                call.cancel()
                return "CANCELLED", tokens, ""
        return "OK", tokens, ""
    except grpc.RpcError as exc:
        return exc.code().name, tokens, exc.details() or ""


def test_sigkill_under_load_loses_no_request_that_had_not_started(tiny_llama, tmp_path):
    """Kill each worker once at a random moment under a steady load of streams, restart it, tally everything."""
    rng = random.Random(7)
    outcomes: list[tuple[str, int, str]] = []
    stop = threading.Event()
    with cluster(tiny_llama, tmp_path) as (router, workers):
        def client(seed: int) -> None:
            local = random.Random(seed)
            for index in range(40):
                if stop.is_set():
                    return
                prompt = [local.randrange(10, 300) for _ in range(local.randint(5, 40))]
                request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=24,
                                                  ignore_eos=True, request_id=f"c{seed}-{index}",
                                                  sampling=common_pb2.SamplingParams(temperature=0.0))
                outcomes.append(_stream(router, request))

        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(client, seed) for seed in range(4)]
            for name in ("a", "b"):
                time.sleep(rng.uniform(1.0, 3.0))
                workers[name].process.kill()
                time.sleep(rng.uniform(0.2, 1.0))
                restart(workers, name, tiny_llama, tmp_path)
                router.wait_for_backends({"a", "b"}, timeout=30)
            time.sleep(1.0)
            stop.set()
            for future in clients:
                future.result(timeout=120)

        assert len(outcomes) >= 20
        for status, tokens, details in outcomes:
            if status == "OK":
                assert tokens == 24
            else:  # only streams already past their first token on the killed worker may fail
                assert status == "UNAVAILABLE" and tokens > 0 and "failed after streaming" in details, (status, details)
        assert sum(1 for status, *_ in outcomes if status != "OK") <= 2 * 4
        assert_no_leaks(router, workers)


def test_cancellation_storm_leaves_nothing_behind(tiny_llama, tmp_path):
    rng = random.Random(3)
    with cluster(tiny_llama, tmp_path, step_delay_s=0.005) as (router, workers):
        def one(index: int):
            prompt = [rng.randrange(10, 300) for _ in range(rng.randint(3, 60))]
            request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=64,
                                              ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.0))
            mode = index % 3
            if mode == 0:  # cancelled by a tiny deadline, usually before any token
                return _stream(router, request, timeout=rng.uniform(0.01, 0.3))
            return _stream(router, request, cancel_after=rng.randint(1, 40) if mode == 1 else None)

        with ThreadPoolExecutor(24) as pool:
            outcomes = list(pool.map(one, range(240)))
        assert {status for status, *_ in outcomes} <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}
        assert sum(1 for status, *_ in outcomes if status == "OK") >= 40
        assert_no_leaks(router, workers)


def test_a_short_deadline_reaches_the_worker_and_aborts_the_work(tiny_llama, tmp_path):
    with cluster(tiny_llama, tmp_path, names=("a",), step_delay_s=0.05) as (router, workers):
        status, _, _ = _stream(router, _request(200), timeout=0.5)
        assert status == "DEADLINE_EXCEEDED"
        assert_no_leaks(router, workers, timeout=5)


def test_router_restart_while_workers_keep_running(tiny_llama, tmp_path):
    with cluster(tiny_llama, tmp_path, step_delay_s=0.05) as (router, workers):
        call = router.stub.Generate(_request(200), timeout=60)
        next(call)
        router.process.kill()  # the stream dies with the router; the worker must drop the orphan
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        router.close()
        restarted = RouterProcess(tiny_llama, tmp_path / "router2.log",
                                  [f"{n}=cpu@{w.address}" for n, w in workers.items()])
        try:
            restarted.wait_for_health(SERVING)
            restarted.wait_for_backends({"a", "b"})
            assert _stream(restarted, _request(5))[:2] == ("OK", 5)
            assert_no_leaks(restarted, workers)
        finally:
            restarted.close()


def test_a_frozen_worker_is_found_out_by_keepalive_and_its_stream_ends(tiny_llama, tmp_path):
    """SIGSTOP a worker for good, mid-stream: its connection stays open and silent, so only the router's
    keepalive pings find it out. Its stream ends UNAVAILABLE, long before the call's own deadline, and the
    worker leaves routing; after SIGCONT it serves again and nothing leaked."""
    keepalive = ("--worker-keepalive-s", "1")
    with cluster(tiny_llama, tmp_path, step_delay_s=0.05, router_args=keepalive) as (router, workers):
        call = router.stub.Generate(_request(1000), timeout=120)  # 50 s of steps at the harness's delay
        frozen = next(call).decision.chosen_worker
        assert next(call).token_ids
        with stopped(workers[frozen]):
            with pytest.raises(grpc.RpcError) as ended:
                for _ in call:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value.details()
            router.wait_for_backends(set(workers) - {frozen})
        router.wait_for_backends(set(workers))
        assert_no_leaks(router, workers)


@pytest.mark.parametrize("prefix_index", [True, False], ids=["indexed", "probed"])
def test_a_stopped_worker_does_not_stall_routing(tiny_llama, tmp_path, prefix_index):
    """SIGSTOP one worker: no decision waits long for it, and the other worker keeps serving; after SIGCONT
    everything completes. Decisions read each worker's latest snapshot and prefix index, plus in-flight
    credit; workers that send no index (builds from before it) are probed instead, and the stopped one's
    probes time out into its latest snapshot. Policy least_loaded spreads the requests by count (in-flight
    credit included), whatever rates the two workers measured."""
    env = {} if prefix_index else {"HARNESS_WATCH_STATE_WITHOUT_PREFIX_CACHE": "1"}
    request = _request(4)
    request.policy = "least_loaded"
    with cluster(tiny_llama, tmp_path, step_delay_s=0.0, worker_env=env) as (router, workers):
        with stopped(workers["a"]):
            def timed(index):
                start = time.monotonic()
                call = router.stub.Generate(request, timeout=60)
                decision = next(call).decision
                decided = time.monotonic() - start
                if decision.chosen_worker == "b":
                    return decision, decided, list(call)
                return decision, decided, call

            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(timed, range(6)))
            sources = {s.worker: s.state_source for decision, _, _ in results for s in decision.scores}
            assert sources == ({"a": "index", "b": "index"} if prefix_index else {"a": "snapshot", "b": "estimate"})
            assert all(decided < 2.0 for _, decided, _ in results)
            on_b = [responses for decision, _, responses in results if decision.chosen_worker == "b"]
            assert len(on_b) >= 2 and all(responses[-1].result.usage.output_tokens == 4 for responses in on_b)
        for decision, _, call in results:
            if decision.chosen_worker == "a":
                assert list(call)[-1].result.usage.output_tokens == 4
        assert_no_leaks(router, workers)


def test_an_engine_fault_ends_in_flight_requests_clearly_and_the_router_routes_around(tiny_llama, tmp_path):
    """Worker a's model step raises after 30 steps (test harness only): its streams end with UNAVAILABLE
    (after tokens) or fail over to b (before the first token); a turns NOT_SERVING; later requests go to b."""
    faulty = WorkerProcess(tiny_llama, tmp_path / "a.log", launcher=HARNESS,
                           env={"HARNESS_FAIL_AFTER_STEPS": "30", "HARNESS_STEP_DELAY_S": "0.01"})
    healthy = WorkerProcess(tiny_llama, tmp_path / "b.log", launcher=HARNESS, env={"HARNESS_STEP_DELAY_S": "0.01"})
    router = None
    try:
        faulty.wait_for_health()
        healthy.wait_for_health()
        router = RouterProcess(tiny_llama, tmp_path / "router.log", [f"a=gpu@{faulty.address}", f"b=cpu@{healthy.address}"])
        router.wait_for_health(SERVING)
        router.wait_for_backends({"a", "b"})
        pinned = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(30, 50))),
                                         max_new_tokens=60, ignore_eos=True, policy="gpu_only",
                                         sampling=common_pb2.SamplingParams(temperature=0.0))
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda _: _stream(router, pinned), range(3)))
        for status, tokens, details in outcomes:  # 3 × 60 tokens need more than 30 steps: every stream is hit
            assert status == "UNAVAILABLE" and tokens > 0 and "failed after streaming" in details, (status, details)
            assert "injected fault" in details
        wait_until(lambda: faulty.health_status() != SERVING)
        router.wait_for_backends({"b"})
        for _ in range(3):
            responses = list(router.stub.Generate(_request(5), timeout=30))
            assert responses[0].decision.chosen_worker == "b" and responses[-1].result.usage.output_tokens == 5
        assert faulty.alive  # a failed engine keeps the process up, reporting NOT_SERVING
    finally:
        for process in (router, faulty, healthy):
            if process is not None:
                process.close()
