"""Samples of one prompt (``n``): the prompt's KV cache blocks are held once, not once per sample.

Starts a real cpu_worker on 127.0.0.1 with the default model and sends a fresh prompt for 64 new tokens
(EOS ignored, sampled at temperature 1) twice: as one request with n = 4, and as 4 separate requests sent
at once; with a 512-token prompt, then a 128-token one. While each runs, the worker's own block counts
(``WatchState``, every 10 ms) give the most KV blocks in use; they are set against the prompt's blocks held
once beside 4 samples' outputs, and 4 times prompt and output. Also reports each way's wall time. (The
separate requests, sent from 4 threads, reach the engine a step or more apart, so the later ones find the
first one's blocks in the prefix cache too: the worker shares a prompt's blocks between any requests that
are not computed in the same step; ``n`` makes that sure.)
Writes bench/results/samples.json.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

from tandem.launch import ServiceProcess
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LENGTHS, NEW_TOKENS, SAMPLES = (512, 128), 64, 4


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class PeakBlocks:
    """The most KV blocks the worker reports in use while it runs, from its state stream."""

    def __init__(self, stub):
        self.peak = 0
        self._call = stub.WatchState(worker_pb2.WatchStateRequest(interval_s=0.01), timeout=600)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for state in self._call:
                self.peak = max(self.peak, state.kv_blocks_used)
        except Exception:  # cancelled by stop()
            pass

    def stop(self) -> int:
        time.sleep(0.1)
        self._call.cancel()
        self._thread.join()
        return self.peak


def run(stub, requests: list[worker_pb2.GenerateRequest]) -> dict:
    """Send ``requests`` at once; the peak blocks in use, the seconds until all ended, the output tokens."""
    peak = PeakBlocks(stub)
    outputs = [0] * len(requests)

    def one(index: int) -> None:
        outputs[index] = sum(len(r.token_ids) for r in stub.Generate(requests[index], timeout=600))

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    return {"peak_kv_blocks_used": peak.stop(), "seconds": seconds, "output_tokens": sum(outputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS / "samples.json")
    args = parser.parse_args()

    from tandem.model_files import resolve_model

    RESULTS.mkdir(parents=True, exist_ok=True)
    worker = ServiceProcess("cpu_worker", "cpu_worker", ["--model", str(resolve_model(None))],
                            RESULTS / "samples-bench.log")
    stub = worker_pb2_grpc.WorkerStub(worker.channel)
    try:
        worker.wait_for_health()
        block_size = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).block_size
        rng = random.Random(0)

        def request(prompt: list[int], n: int, seed: int = 0) -> worker_pb2.GenerateRequest:
            return worker_pb2.GenerateRequest(
                prompt_token_ids=worker_pb2.TokenIds(ids=prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True,
                sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed), n=n)

        runs = {}
        for length in PROMPT_LENGTHS:
            prompts = [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(2)]  # nothing cached
            runs[length] = (run(stub, [request(prompts[0], SAMPLES)]),
                            run(stub, [request(prompts[1], 1, seed) for seed in range(SAMPLES)]))
    finally:
        worker.terminate()
    report = {"benchmark": "samples", "new_tokens": NEW_TOKENS, "samples": SAMPLES, "block_size": block_size,
              "prompts": []}
    for length, (shared, separate) in runs.items():
        shared_tokens = (length - 1) // block_size * block_size  # what the other samples find cached
        report["prompts"].append({
            "prompt_tokens": length, "prompt_blocks": blocks(length, block_size),
            "expected_blocks_prompt_held_once": blocks(length + NEW_TOKENS, block_size)
            + (SAMPLES - 1) * blocks(length - shared_tokens + NEW_TOKENS, block_size),
            "expected_blocks_prompt_held_per_sample": SAMPLES * blocks(length + NEW_TOKENS, block_size),
            "n_in_one_request": shared, "separate_requests_at_once": separate,
        })
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
