"""`tandem bench` against real workers and a router on 127.0.0.1 (tiny model)."""

from __future__ import annotations

import json

import httpx
import pytest

from tandem.loadgen.live import OpenAIServer
from tandem.loadgen.live import main as bench_main
from tandem.loadgen.workloads import WorkloadRequest
from tandem.launch import free_port
from tests.integration.workers import SERVING, RouterProcess, running_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-stack")
    with running_worker(tiny_llama, logs / "cpu.log", "--max-active", "4") as cpu, \
            running_worker(tiny_llama, logs / "gpu.log", "--max-active", "4", module_kind="gpu") as gpu:
        http_port = free_port()
        router = RouterProcess(tiny_llama, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"],
                               "--http-port", str(http_port))
        router.http_url = f"http://127.0.0.1:{http_port}/v1"
        try:
            router.wait_for_health(SERVING)
            router.wait_for_backends({"cpu", "gpu"})
            yield router, cpu, gpu
        finally:
            router.close()


def test_seed_burst_through_the_router_records_every_request_and_decision(stack, tmp_path):
    router, _, _ = stack
    output = tmp_path / "burst.json"
    assert bench_main(["--router", router.address, "--requests", "6", "--prompt-tokens", "100", "--prefix-tokens", "80",
                       "--max-new-tokens", "16", "--policy", "cost", "gpu_only", "--output", str(output)]) == 0
    for policy in ("cost", "gpu_only"):
        result = json.loads((tmp_path / f"burst-{policy}.json").read_text())
        assert result["outcomes"] == {"OK": 6} and result["output_tokens"] == 6 * 16
        assert result["makespan_s"] > 0 and result["ttft_p50_s"] <= result["e2e_p50_s"]
        assert [d["request_id"] for d in result["decisions"]] == [f"burst-{i:05d}" for i in range(6)]
        assert all(d["policy"] == policy for d in result["decisions"])
        assert all(r["cached_tokens"] == 80 for r in result["requests"])  # the prefix was warmed on both
        assert sum(result["requests_per_worker"].values()) == 6
        assert (tmp_path / f"burst-{policy}-timeline.png").stat().st_size > 1000
    gpu_only = json.loads((tmp_path / "burst-gpu_only.json").read_text())
    assert gpu_only["requests_per_worker"] == {"cpu": 0, "gpu": 6}
    assert (tmp_path / "burst-cdf.png").stat().st_size > 1000


def test_poisson_outputs_end_at_their_drawn_length_below_the_budget(stack, tmp_path):
    _, cpu, _ = stack
    output = tmp_path / "poisson.json"
    assert bench_main(["--worker", cpu.address, "--workload", "poisson", "--requests", "12", "--rate", "20",
                       "--prompt-tokens-mean", "60", "--prefix-tokens", "32", "--output-tokens-mean", "6",
                       "--max-new-tokens", "64", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["outcomes"] == {"OK": 12} and result["decisions"] == []
    assert result["requests_per_worker"] == {"worker": 12}
    assert all(r["output_tokens"] < 64 for r in result["requests"])


def test_bad_workload_flags_are_usage_errors(stack, capsys):
    router, _, _ = stack
    with pytest.raises(SystemExit):
        bench_main(["--router", router.address, "--prefix-tokens", "600"])
    assert "prefix_tokens" in capsys.readouterr().err


SMALL_BURST = ["--requests", "6", "--prompt-tokens", "100", "--prefix-tokens", "80", "--max-new-tokens", "16"]


def test_seed_burst_through_the_openai_api_records_the_same_shapes_as_grpc(stack, tmp_path):
    router, _, _ = stack
    assert bench_main(["--openai", router.http_url, "--workload", "seed-burst", *SMALL_BURST, "--seed", "7",
                       "--vocab-size", "400", "--policy", "cost", "gpu_only",
                       "--output", str(tmp_path / "http.json")]) == 0
    assert bench_main(["--router", router.address, *SMALL_BURST, "--seed", "9",
                       "--output", str(tmp_path / "grpc.json")]) == 0
    grpc_run = json.loads((tmp_path / "grpc.json").read_text())
    for policy in ("cost", "gpu_only"):
        result = json.loads((tmp_path / f"http-{policy}.json").read_text())
        assert result["outcomes"] == {"OK": 6} and result["output_tokens"] == 6 * 16 and result["decisions"] == []
        assert all(r["arrival_s"] < r["first_token_s"] <= r["finish_s"] for r in result["requests"])
        assert 0 < result["ttft_p50_s"] <= result["e2e_p50_s"]
        assert {r["worker"] for r in result["requests"]} <= {"cpu", "gpu"}  # from the x-tandem-worker header
        assert set(result["requests_per_worker"]) <= {"cpu", "gpu"} and sum(result["requests_per_worker"].values()) == 6
        # The prefix was warmed through the router, on the worker it chose; that worker reports it cached.
        assert any(r["cached_tokens"] >= 80 for r in result["requests"])
        assert result.keys() == grpc_run.keys()
        assert result["requests"][0].keys() == grpc_run["requests"][0].keys()
        assert result["workers"][0].keys() == grpc_run["workers"][0].keys()
        assert result["workload"] == {**grpc_run["workload"], "seed": result["workload"]["seed"]}
    assert json.loads((tmp_path / "http-gpu_only.json").read_text())["requests_per_worker"] == {"gpu": 6}
    assert (tmp_path / "http-cdf.png").stat().st_size > 1000


@pytest.mark.filterwarnings("ignore:No artists with labels:UserWarning")  # plots of a run with no request completed
def test_openai_target_records_http_errors_per_request(stack, tmp_path):
    router, _, _ = stack
    output = tmp_path / "missing-model.json"
    assert bench_main(["--openai", router.http_url, "--model", "no-such-model", "--requests", "2",
                       "--prompt-tokens", "20", "--prefix-tokens", "0", "--max-new-tokens", "4", "--vocab-size", "400",
                       "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["outcomes"] == {"HTTP_404": 2} and result["requests_per_worker"] == {"server": 0}


def test_openai_flags_are_usage_errors_with_grpc_targets(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--router", "127.0.0.1:1", "--model", "m"])
    assert "--openai only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--router", "127.0.0.1:1", "--openai", "http://127.0.0.1:1/v1"])
    assert "not allowed with" in capsys.readouterr().err


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _text(text: str) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def _complete(body: bytes, request: WorkloadRequest, status: int = 200, headers=None):
    seen = []

    def handler(http_request: httpx.Request) -> httpx.Response:
        seen.append(http_request)
        return httpx.Response(status, headers={"content-type": "text/event-stream", **(headers or {})}, content=body)

    async with OpenAIServer("http://server.test/v1", "k3y", transport=httpx.MockTransport(handler)) as server:
        reply = await server.complete(request, lambda: 1.5, "m")
    return reply, seen


def _request(output_tokens: int = 3, max_new_tokens: int = 3) -> WorkloadRequest:
    return WorkloadRequest("r-0", 0.0, (11, 12, 13), max_new_tokens, output_tokens)


async def test_a_streamed_completion_counts_text_chunks_and_takes_usage_last():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    reply, seen = await _complete(_sse(_text(""), _text("a"), _text("bc"), usage, "[DONE]"), _request(),
                                  headers={"x-tandem-worker": "gpu"})
    assert (reply.worker, reply.first_token_s, reply.tokens, reply.cached_tokens) == ("gpu", 1.5, 3, 2)
    assert reply.status == "OK"
    body = json.loads(seen[0].content)
    assert seen[0].url == "http://server.test/v1/completions" and seen[0].headers["authorization"] == "Bearer k3y"
    assert body == {"model": "m", "prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}


async def test_a_streamed_completion_ends_at_its_real_length_and_reports_failures():
    reply, _ = await _complete(_sse(_text("a"), _text("b")), _request(output_tokens=1, max_new_tokens=8))
    assert (reply.worker, reply.tokens, reply.status) == ("server", 1, "OK")  # closed after its one token
    error = {"error": {"message": "worker lost", "type": "service_unavailable_error"}}
    reply, _ = await _complete(_sse(_text("a"), error), _request())
    assert (reply.first_token_s, reply.tokens, reply.status) == (1.5, 1, "service_unavailable_error")
    reply, _ = await _complete(_sse(_text("a")), _request())
    assert reply.status == "INCOMPLETE_STREAM"
    reply, _ = await _complete(b'{"error": {"message": "busy"}}', _request(), status=429)
    assert (reply.first_token_s, reply.tokens, reply.status) == (None, 0, "HTTP_429")
