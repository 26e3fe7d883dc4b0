"""Worker benchmark: how cheap a probe is, idle and while the worker decodes a full batch, and what the
router pays instead when it looks prompts up in its own copy of the worker's prefix index.

Starts a real cpu_worker on 127.0.0.1 with the default model and asks for an estimate of a 516-token
prompt (496 of them cached) N times idle, then N times while 8 requests stream: each time as a unary
Estimate call and as one message on an open EstimateStream call. Then it builds a router's prefix index
of the worker from WatchState and times a re-placement round's lookups of 64 such prompts in it: hashing
each prompt's blocks (once per request) and looking the hashes up (every round). Writes
bench/results/worker.json with latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import threading
import time
from pathlib import Path

from router_svc.prefix_index import PrefixIndex, PromptBlocks
from tandem.loadgen.results import percentile
from tandem.launch import ServiceProcess
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
ROUND_PROMPTS = 64


def percentiles(samples_s: list[float]) -> dict[str, float]:
    samples_ms = [1000 * s for s in samples_s]
    return {"p50_ms": percentile(samples_ms, 50), "p95_ms": percentile(samples_ms, 95),
            "p99_ms": percentile(samples_ms, 99), "max_ms": max(samples_ms)}


def time_estimates(stub, prompt: list[int], count: int) -> list[float]:
    request = worker_pb2.EstimateRequest(prompt_token_ids=prompt)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        state = stub.Estimate(request, timeout=5)
        samples.append(time.perf_counter() - start)
    assert state.cached_tokens == 496, state.cached_tokens
    return samples


def time_stream_estimates(stub, prompt: list[int], count: int) -> list[float]:
    request = worker_pb2.EstimateRequest(prompt_token_ids=prompt)
    outgoing: queue.Queue = queue.Queue()
    answers = stub.EstimateStream(iter(outgoing.get, None), timeout=600)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        outgoing.put(request)
        state = next(answers)
        samples.append(time.perf_counter() - start)
    outgoing.put(None)
    assert state.cached_tokens == 496, state.cached_tokens
    return samples


def time_index_round(stub, prompt: list[int], count: int) -> dict[str, dict[str, float]]:
    call = stub.WatchState(worker_pb2.WatchStateRequest(prefix_cache_changes=True), timeout=60)
    index = PrefixIndex()
    while not index.synced:
        state = next(call)
        index.apply(state.prefix_cache_changes)
    call.cancel()
    first, later = [], []
    for _ in range(count):
        prompts = [PromptBlocks(prompt) for _ in range(ROUND_PROMPTS)]
        start = time.perf_counter()
        answers = [index.cached(p, state.block_size) for p in prompts]
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        answers = [index.cached(p, state.block_size) for p in prompts]
        later.append(time.perf_counter() - start)
    assert [tokens for tokens, _ in answers] == [496] * ROUND_PROMPTS, answers[0]
    return {"hash_and_look_up": percentiles(first), "look_up": percentiles(later)}


def time_probes(stub, prompt: list[int], count: int) -> dict[str, dict[str, float]]:
    return {"estimate": percentiles(time_estimates(stub, prompt, count)),
            "estimate_stream": percentiles(time_stream_estimates(stub, prompt, count)),
            f"router_index_round_{ROUND_PROMPTS}": time_index_round(stub, prompt, max(1, count // 5))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--output", type=Path, default=RESULTS / "worker.json")
    args = parser.parse_args()

    from tandem.model_files import resolve_model

    model_dir = resolve_model(None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    worker = ServiceProcess("cpu_worker", "cpu_worker", ["--model", str(model_dir)], RESULTS / "worker-bench.log")
    worker.stub = worker_pb2_grpc.WorkerStub(worker.channel)
    try:
        worker.wait_for_health()
        rng = random.Random(0)
        prefix = [rng.randrange(3, 49152) for _ in range(496)]
        prompt = prefix + [rng.randrange(3, 49152) for _ in range(20)]
        greedy = common_pb2.SamplingParams(temperature=0)
        list(worker.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prefix + [5]),
                                                             max_new_tokens=1, sampling=greedy)))
        idle = time_probes(worker.stub, prompt, args.count)

        def stream() -> None:
            suffix = [rng.randrange(3, 49152) for _ in range(20)]
            request = worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prefix + suffix),
                                                 max_new_tokens=400, sampling=greedy, ignore_eos=True)
            for _ in worker.stub.Generate(request, timeout=600):
                pass

        streams = [threading.Thread(target=stream) for _ in range(8)]
        for thread in streams:
            thread.start()
        time.sleep(1.0)
        busy = time_probes(worker.stub, prompt, args.count)
        running = worker.stub.Estimate(worker_pb2.EstimateRequest(), timeout=5).num_running
        for thread in streams:
            thread.join()
    finally:
        worker.terminate()
    report = {
        "benchmark": "worker_probes",
        "prompt_tokens": 516,
        "cached_tokens": 496,
        "calls": args.count,
        "idle": idle,
        "busy": {**busy, "running_requests": running},
    }
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
