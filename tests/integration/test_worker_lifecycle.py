"""Worker processes through start-up, drain, engine failure, and the gpu_worker's device choice."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from tandem.v1 import common_pb2, worker_pb2
from tests.integration.workers import HARNESS, NOT_SERVING, REPO, SERVING, WorkerProcess

GREEDY = common_pb2.SamplingParams(temperature=0)


def long_request(max_new_tokens: int = 400) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(20))),
                                      max_new_tokens=max_new_tokens, sampling=GREEDY, ignore_eos=True)


def harness_worker(tiny_llama, tmp_path, **env) -> WorkerProcess:
    return WorkerProcess(tiny_llama, tmp_path / "worker.log", launcher=HARNESS,
                         env={key: str(value) for key, value in env.items()})


def test_health_through_startup_and_sigterm_drain(tiny_llama, tmp_path):
    worker = harness_worker(tiny_llama, tmp_path, HARNESS_STEP_DELAY_S=0.01)
    try:
        first_answer = None
        deadline = time.monotonic() + 60
        while first_answer is None and time.monotonic() < deadline:
            first_answer = worker.health_status()
        assert first_answer == NOT_SERVING  # the server answers while the model is still loading
        with pytest.raises(grpc.RpcError) as info:
            list(worker.stub.Generate(long_request(4), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "starting" in info.value.details()
        worker.wait_for_health(SERVING)

        stream = worker.stub.Generate(long_request(200), timeout=60)
        received = list(next(stream).token_ids)
        worker.process.send_signal(15)
        worker.wait_for_health(NOT_SERVING, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(worker.stub.Generate(long_request(4), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        responses = list(stream)
        received += [t for r in responses for t in r.token_ids]
        assert len(received) == 200  # the in-flight stream finished during the grace period
        assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert worker.process.wait(30) == 0
    finally:
        worker.close()


def test_engine_failure_ends_streams_and_turns_health_off(tiny_llama, tmp_path):
    # 40 steps of 20 ms: all three requests are in flight when the fault comes, however loaded the machine
    worker = harness_worker(tiny_llama, tmp_path, HARNESS_FAIL_AFTER_STEPS=40, HARNESS_STEP_DELAY_S=0.02)
    try:
        worker.wait_for_health(SERVING)
        streams = [worker.stub.Generate(long_request(), timeout=60) for _ in range(3)]
        for stream in streams:
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected fault" in info.value.details()
        worker.wait_for_health(NOT_SERVING, timeout=10)
        state = worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5)
        assert state.serving_state == common_pb2.SERVING_STATE_FAILED
        assert state.num_running == 0 and state.kv_blocks_used == 0
        with pytest.raises(grpc.RpcError) as info:
            list(worker.stub.Generate(long_request(4), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        worker.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_gpu_worker_without_a_gpu_exits_with_a_clear_message(tiny_llama):
    env = {key: value for key, value in os.environ.items() if key != "TANDEM_DEVICE"}
    result = subprocess.run([sys.executable, "-m", "gpu_worker", "--model", str(tiny_llama), "--port", "0"],
                            capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert result.returncode != 0
    assert "--device cpu" in result.stderr


def test_gpu_worker_on_cpu_configured_through_the_environment(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    monkeypatch.setenv("TANDEM_MAX_ACTIVE", "3")
    worker = WorkerProcess(tiny_llama, tmp_path / "gpu.log", module="gpu_worker")
    try:
        worker.wait_for_health(SERVING)
        info = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert (info.kind, info.device, info.max_active_requests) == (common_pb2.WORKER_KIND_GPU, "cpu", 3)
        state = worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5)
        assert (state.kind, state.device) == (common_pb2.WORKER_KIND_GPU, "cpu")
        assert "running on the CPU" in worker.log()
    finally:
        assert worker.terminate() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_worker_takes_the_gpu_in_bf16_by_default(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_DEVICE", raising=False)
    monkeypatch.delenv("TANDEM_DTYPE", raising=False)
    worker = WorkerProcess(tiny_llama, tmp_path / "gpu.log", module="gpu_worker")
    try:
        worker.wait_for_health(SERVING)
        info = worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert (info.kind, info.device, info.dtype) == (common_pb2.WORKER_KIND_GPU, "cuda", "bfloat16")
        responses = list(worker.stub.Generate(long_request(64), timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 64
        assert responses[-1].result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        state = worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5)
        assert (state.device, state.num_running) == ("cuda", 0) and state.rates.decode_tokens_per_s > 0
    finally:
        assert worker.terminate() == 0


def test_a_model_that_cannot_load_ends_the_process_with_the_reason(tmp_path):
    worker = WorkerProcess(tmp_path / "no-such-model.gguf", tmp_path / "bad.log")
    try:
        assert worker.process.wait(60) != 0
        assert "GGUF file not found" in worker.log()
    finally:
        worker.close()
