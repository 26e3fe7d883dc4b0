"""The router in front of two real workers (kinds cpu and gpu, both on the CPU here), end to end."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.device import TEST_DEVICE
from tests.engine.helpers import hf_greedy
from tandem.launch import free_port
from tests.integration.workers import (
    HARNESS, NOT_SERVING, RouterProcess, WorkerProcess, running_worker, scrape_metrics, seen_by_router,
    serving_router, wait_until,
)

GREEDY = common_pb2.SamplingParams(temperature=0)


def route(prompt, max_new_tokens=8, **fields) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=max_new_tokens,
                                   sampling=GREEDY, ignore_eos=True, **fields)


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("stack")
    with running_worker(tiny_llama, logs / "cpu.log") as cpu, \
            running_worker(tiny_llama, logs / "gpu.log", module_kind="gpu") as gpu:
        router = RouterProcess(tiny_llama, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"],
                               "--metrics-port", str(free_port()))
        with serving_router(router, {"cpu", "gpu"}):
            yield router, {"cpu": cpu, "gpu": gpu}


def test_generate_sends_the_decision_then_the_tokens(stack, tiny_llama):
    router, _ = stack
    prompt = list(range(30, 60))
    responses = list(router.stub.Generate(route(prompt, 10), timeout=60))
    decision = responses[0].decision
    assert decision.policy == "finish_time" and decision.chosen_worker in ("cpu", "gpu")
    assert {s.worker for s in decision.scores} == {"cpu", "gpu"}
    assert all(s.eligible and s.score_s > 0 and s.state_source == "index" for s in decision.scores)
    assert decision.scores[0].score_s <= decision.scores[1].score_s
    assert decision.scores[0].worker == decision.chosen_worker
    assert tokens_of(responses[1:]) == hf_greedy(tiny_llama, prompt, 10)
    assert all(r.worker == decision.chosen_worker for r in responses[1:])
    assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_text_and_chat_prompts_are_tokenized_once_by_the_router(stack):
    router, _ = stack
    text = router_pb2.RouteRequest(prompt_text="The quick brown fox", max_new_tokens=3, sampling=GREEDY, ignore_eos=True)
    chat = router_pb2.RouteRequest(max_new_tokens=3, sampling=GREEDY, ignore_eos=True,
                                   chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")]))
    for request in (text, chat):
        responses = list(router.stub.Generate(request, timeout=60))
        assert responses[0].decision.prompt_tokens == responses[-1].result.usage.prompt_tokens > 0


def test_explain_agrees_with_generate(stack):
    router, _ = stack
    request = route(list(range(200, 260)), 16)
    # Nothing changes in between: the earlier tests' requests are gone from the router's snapshots too.
    wait_until(lambda: all(b.state.num_running == b.state.num_waiting == 0 for b in
                           router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends))
    explained = router.stub.Explain(router_pb2.ExplainRequest(request=request), timeout=10).decision
    generated = next(iter(router.stub.Generate(request, timeout=60))).decision
    assert explained.chosen_worker == generated.chosen_worker
    assert [s.worker for s in explained.scores] == [s.worker for s in generated.scores]
    for a, b in zip(explained.scores, generated.scores):
        assert (a.cached_tokens, a.pending_prefill_tokens, a.pending_decode_tokens) == \
               (b.cached_tokens, b.pending_prefill_tokens, b.pending_decode_tokens)
        assert a.score_s == pytest.approx(b.score_s, rel=0.25)


def wait_until_cached_for_the_router(router: RouterProcess, prompt: list[int], worker: str, tokens: int) -> None:
    """The router learns of a worker's new cache blocks from its next WatchState snapshot, a few ms on."""
    def cached() -> int:
        decision = router.stub.Explain(router_pb2.ExplainRequest(request=route(prompt)), timeout=10).decision
        return next(s.cached_tokens for s in decision.scores if s.worker == worker)

    wait_until(lambda: cached() == tokens, 10)


def test_decisions_read_each_workers_cached_prefix_from_its_index_as_the_worker_counts_it(stack):
    router, workers = stack
    prompt = list(range(330, 380))  # 50 tokens: a hit covers at most 3 blocks of 16
    for name, tokens in (("cpu", prompt[:40]), ("gpu", prompt)):
        list(workers[name].stub.Generate(worker_pb2.GenerateRequest(
            prompt_token_ids=worker_pb2.TokenIds(ids=tokens), max_new_tokens=1, ignore_eos=True), timeout=60))
    asked = {name: worker.stub.Estimate(worker_pb2.EstimateRequest(prompt_token_ids=prompt), timeout=5)
             for name, worker in workers.items()}
    assert {name: state.cached_tokens for name, state in asked.items()} == {"cpu": 32, "gpu": 48}

    def cached_in_decision():
        decision = router.stub.Explain(router_pb2.ExplainRequest(request=route(prompt)), timeout=10).decision
        return {s.worker: (s.cached_tokens, s.state_source) for s in decision.scores}

    wait_until(lambda: cached_in_decision() == {"cpu": (32, "index"), "gpu": (48, "index")}, 10)


def test_saturated_gpu_worker_makes_the_router_offload(stack):
    router, workers = stack
    gpu = workers["gpu"]
    # 12 rounds of 8 requests, about 1.8 s a round here: the gpu worker stays loaded long enough for a busy
    # machine to see it
    load = [gpu.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(40))),
                                                         max_new_tokens=900, sampling=GREEDY, ignore_eos=True), timeout=60)
            for _ in range(96)]
    try:
        for call in load[:8]:
            next(call)

        def explained():  # once the router's snapshot of the gpu worker shows the load
            decision = router.stub.Explain(router_pb2.ExplainRequest(request=route(list(range(70, 90)), 32)),
                                           timeout=10).decision
            gpu_score = next(s for s in decision.scores if s.worker == "gpu")
            return decision if gpu_score.pending_decode_tokens > 20000 and gpu_score.num_running == 8 else None

        assert wait_until(explained, 60).chosen_worker == "cpu"
        responses = list(router.stub.Generate(route(list(range(70, 90)), 4), timeout=60))
        assert responses[0].decision.chosen_worker == "cpu" and responses[-1].worker == "cpu"
    finally:
        for call in load:
            call.cancel()
    wait_until(lambda: (s := gpu.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5)).num_running == 0
               and s.num_waiting == 0)


def test_client_cancel_cancels_the_worker_call(stack):
    router, workers = stack
    call = router.stub.Generate(route(list(range(5, 25)), 900), timeout=60)
    chosen = next(call).decision.chosen_worker
    next(call)
    worker = workers[chosen]
    assert worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5).num_running == 1
    call.cancel()
    wait_until(lambda: (s := worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5)).num_running == 0
               and s.kv_blocks_used == 0)


def test_each_decision_of_a_burst_counts_every_request_routed_before_it_once(stack):
    """A request the router sent counts, as in-flight credit, until the worker reports it, and then
    as reported: never twice, never not at all. So a simultaneous burst spreads evenly by load."""
    router, workers = stack
    wait_until(lambda: set(seen_by_router(router).values()) == {(0, 0)})  # the earlier tests' requests are gone
    calls = [router.stub.Generate(route([300 + i] * 24, 900, policy="least_loaded"), timeout=60) for i in range(8)]
    try:
        with ThreadPoolExecutor(8) as pool:
            decisions = list(pool.map(lambda call: next(call).decision, calls))
    finally:
        for call in calls:
            call.cancel()
    seen = sorted(sum(s.num_running + s.num_waiting for s in d.scores) for d in decisions)
    assert seen == list(range(8)), decisions
    assert Counter(d.chosen_worker for d in decisions) == {"cpu": 4, "gpu": 4}
    for worker in workers.values():
        wait_until(lambda: worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5).num_running == 0)


def test_list_backends_reports_every_worker(stack):
    router, _ = stack
    backends = {b.name: b for b in router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends}
    assert set(backends) == {"cpu", "gpu"}
    for name, backend in backends.items():
        assert backend.healthy and backend.status == "serving" and backend.device == {"cpu": "cpu", "gpu": TEST_DEVICE}[name]
        assert backend.state.rates.decode_tokens_per_s > 0 and len(backend.model_fingerprint) == 64
    assert backends["cpu"].kind == common_pb2.WORKER_KIND_CPU and backends["gpu"].kind == common_pb2.WORKER_KIND_GPU
    assert sum(b.routed_requests for b in backends.values()) > 0


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        (dict(max_new_tokens=4), "prompt"),
        (dict(prompt_text="", max_new_tokens=4), "prompt_text"),
        (dict(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 2]), max_new_tokens=0), "max_new_tokens"),
        (dict(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4,
              sampling=common_pb2.SamplingParams(top_p=0)), "sampling.top_p"),
        (dict(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4, policy="fastest"), "policy"),
        (dict(chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="robot", content="x")]),
              max_new_tokens=4), "chat.messages[0].role"),
        (dict(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 99999]), max_new_tokens=4), "prompt_token_ids"),
    ],
)
def test_invalid_input_names_the_field(stack, request_fields, field):
    router, _ = stack
    with pytest.raises(grpc.RpcError) as info:
        list(router.stub.Generate(router_pb2.RouteRequest(**request_fields), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_decisions_are_logged_as_json_lines_and_counted_in_metrics(stack):
    import json

    router, _ = stack
    request_id = "logged-decision"
    list(router.stub.Generate(route(list(range(10, 20)), 2, request_id=request_id), timeout=60))
    lines = [json.loads(line.split("tandem.router.decisions: ", 1)[1])
             for line in router.log().splitlines() if "tandem.router.decisions: " in line]
    entry = next(e for e in lines if e["request_id"] == request_id)
    assert entry["event"] == "route" and entry["policy"] == "finish_time" and entry["chosen"] in ("cpu", "gpu")
    assert {"score_s", "cached_tokens", "pending_prefill_tokens", "pending_decode_tokens", "inflight_requests",
            "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_s", "decode_s"} <= set(entry["scores"][0])
    before = scrape_metrics(router)
    list(router.stub.Generate(route(list(range(10, 20)), 2), timeout=60))
    after = scrape_metrics(router)
    decisions = {key: value for key, value in after.items() if key[0] == "tandem_router_decisions_total"}
    assert sum(decisions.values()) - sum(v for k, v in before.items() if k[0] == "tandem_router_decisions_total") == 1
    ok = ("tandem_router_rpcs_total", (("code", "OK"), ("method", "Generate")))
    assert after[ok] - before.get(ok, 0) == 1
    assert after[("tandem_router_time_to_first_token_seconds_count", (("frontend", "grpc"),))] >= 1
    e2e = ("tandem_router_request_duration_seconds_count", (("frontend", "grpc"),))
    assert after[e2e] - before.get(e2e, 0) == 1
    assert any(key[0] == "tandem_router_worker_score_seconds_bucket" for key in after)


def test_no_healthy_worker_gives_unavailable_naming_the_workers(tiny_llama, tmp_path):
    router = RouterProcess(tiny_llama, tmp_path / "router.log",
                           [f"a=cpu@127.0.0.1:{free_port()}", f"b=gpu@127.0.0.1:{free_port()}"])
    try:
        router.wait_for_health(NOT_SERVING)
        with pytest.raises(grpc.RpcError) as info:
            list(router.stub.Generate(route([1, 2, 3]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "a (unreachable" in info.value.details() and "b (unreachable" in info.value.details()
    finally:
        assert router.terminate() == 0


@pytest.mark.slow
def test_failover_mid_stream_failure_and_restart(tiny_llama, tmp_path):
    """A worker killed before its first token: the request completes elsewhere. Killed mid-stream: a clear
    UNAVAILABLE. Restarted: routed to again, without restarting the router."""
    slow_env = {"HARNESS_STEP_DELAY_S": "0.4"}
    slow = WorkerProcess(tiny_llama, tmp_path / "slow.log", launcher=HARNESS, env=slow_env)
    with running_worker(tiny_llama, tmp_path / "fast.log") as fast:
        router = RouterProcess(tiny_llama, tmp_path / "router.log", [f"slow=gpu@{slow.address}", f"fast=cpu@{fast.address}"])
        try:
            slow.wait_for_health()
            router.wait_for_backends({"slow", "fast"})
            prefix = list(range(100, 164))
            list(slow.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prefix + [1]),
                                                               max_new_tokens=1), timeout=60))
            prompt = prefix + [2, 3]
            wait_until_cached_for_the_router(router, prompt, "slow", 64)

            # cache_aware picks the worker holding the prefix: the slow one. Kill it during its prefill.
            call = router.stub.Generate(route(prompt, 6, policy="cache_aware"), timeout=60)
            first = next(call).decision
            assert first.chosen_worker == "slow"
            slow.process.kill()
            responses = list(call)
            retry = responses[0].decision
            assert retry.chosen_worker == "fast" and list(retry.failed_workers) == ["slow"]
            assert tokens_of(responses[1:]) == hf_greedy(tiny_llama, prompt, 6)
            slow.close()

            # Restart on the same port: the router picks it up again.
            slow = WorkerProcess(tiny_llama, tmp_path / "slow2.log", launcher=HARNESS, env=slow_env, port=slow.port)
            slow.wait_for_health()
            router.wait_for_backends({"slow", "fast"}, timeout=30)

            # Killed after tokens were streamed: UNAVAILABLE naming the worker, no duplicated tokens.
            prefix = list(range(200, 264))  # cached on the restarted slow worker only
            prompt = prefix + [2, 3]
            list(slow.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prefix + [1]),
                                                               max_new_tokens=1), timeout=60))
            wait_until_cached_for_the_router(router, prompt, "slow", 64)
            call = router.stub.Generate(route(prompt, 50, policy="cache_aware"), timeout=60)
            assert next(call).decision.chosen_worker == "slow"
            received = list(next(call).token_ids)
            slow.process.kill()
            with pytest.raises(grpc.RpcError) as info:
                for response in call:
                    received += list(response.token_ids)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker slow failed after streaming" in info.value.details()
            assert received == hf_greedy(tiny_llama, prompt, 50)[: len(received)]
        finally:
            router.close()
            slow.close()


def test_the_router_learns_a_length_keys_output_share_and_routes_by_it(stack, tiny_llama):
    from router_svc.output_lengths import OutputLengths

    router, _ = stack
    prompt = list(range(300, 330))
    greedy = hf_greedy(tiny_llama, prompt, 16)
    stop_after = greedy.index(greedy[2]) + 1  # stops at the first occurrence of the third greedy token
    replay = OutputLengths()
    for _ in range(4):
        request = route(prompt, 16, length_key="short-replies", stop_token_ids=[greedy[2]])
        result = list(router.stub.Generate(request, timeout=60))[-1].result
        assert result.usage.output_tokens == stop_after < 16
        replay.observe("short-replies", result.usage.output_tokens, 16)
    explained = router.stub.Explain(router_pb2.ExplainRequest(request=route(prompt, 16, length_key="short-replies")),
                                    timeout=10).decision
    assert explained.length_key == "short-replies"
    assert explained.expected_new_tokens == replay.expected_tokens("short-replies", 16) < 16
    listing = router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
    learned = {entry.key: entry for entry in listing.output_lengths}
    assert learned["short-replies"].samples == 4
    assert learned["short-replies"].fraction == pytest.approx(replay.fraction("short-replies"))
    assert learned[""].samples >= 4  # the figure over all requests
    assert scrape_metrics(router)[("tandem_router_output_fraction", (("length_key", "short-replies"),))] == \
        pytest.approx(replay.fraction("short-replies"))
    with pytest.raises(grpc.RpcError) as info:
        list(router.stub.Generate(route(prompt, 4, length_key="\x00"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("length_key:")
