"""A CPU decode step's time budget: milliseconds per step at batch 1 and 8 (600-token contexts sharing
a 496-token prefix, the article's shape), against the floor that reading the weights at this machine's
measured bandwidth sets: the step as it runs (every decoder layer in one kernel call), and the same step
one op at a time, split into the CPU kernels' linears, their decode attention and everything else (the
other kernels, torch ops, Python). Writes bench/results/step-budget.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from pathlib import Path

import torch

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.model.cpu_kernels import CpuKernels
from tandem.engine.model.factory import build_engine
from tandem.engine.request import Request
from tandem.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
TIMED = ("linear", "decode_attention")


def read_bandwidth_gb_s(repeats: int = 5) -> float:
    """GB/s that torch.sum reads a 256 MiB float32 tensor at, with the current threads."""
    data = torch.ones(64 * 1024 * 1024)
    data.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        data.sum()
    return data.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def timed_steps(engine, batch: int, steps: int, spent: collections.Counter) -> dict:
    rng = random.Random(batch)
    prefix = [rng.randrange(3, engine.executor.vocab_size) for _ in range(496)]
    for index in range(batch):
        prompt = prefix + [rng.randrange(3, engine.executor.vocab_size) for _ in range(20)]
        engine.add_request(Request(f"b{batch}-{index}", prompt, 2 * steps + 100, SamplingParams(temperature=0),
                                   ignore_eos=True))
    for _ in range(80):  # prefill, then decodes until the contexts are about 600 tokens long
        engine.step()
    model = engine.executor.model
    fused = model.decode_layers
    times = {}
    for mode, layers in (("step_ms", fused), ("one_op_at_a_time_step_ms", None)):
        model.decode_layers = layers
        spent.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times[mode] = (time.perf_counter() - start) * 1000 / steps
    model.decode_layers = fused
    for request_id in [f"b{batch}-{index}" for index in range(batch)]:
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    parts = {f"{name}_ms": spent[name] * 1000 / steps for name in TIMED}  # one op at a time
    return {**times, **parts, "other_ms": times["one_op_at_a_time_step_ms"] - sum(parts.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine = build_engine(None, "cpu", "float32", SchedulerConfig(max_active_requests=8),
                          CacheConfig(num_kv_blocks=1024), calibrate=False)
    runner = engine.executor
    if runner.model.decode_layers is None:
        raise SystemExit("the CPU kernels cannot run here (see the log above)")
    spent: collections.Counter = collections.Counter()
    for name in TIMED:
        kernel = getattr(CpuKernels, name)

        def timed(self, *args, _kernel=kernel, _name=name):
            start = time.perf_counter()
            result = _kernel(self, *args)
            spent[_name] += time.perf_counter() - start
            return result

        setattr(CpuKernels, name, timed)

    decode_bytes = sum(module.decode_weight.nbytes for module in runner.model.modules()
                       if getattr(module, "decode_weight", None) is not None)
    bandwidth = read_bandwidth_gb_s()
    report = {"threads": args.threads, "decode_weight_bytes": decode_bytes, "read_bandwidth_gb_s": bandwidth,
              "weight_read_floor_ms": decode_bytes / bandwidth / 1e6,
              "batches": {batch: timed_steps(engine, batch, args.steps, spent) for batch in (1, 8)}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step-budget.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"decode weights {decode_bytes / 1e6:.0f} MB at {bandwidth:.1f} GB/s: "
          f"{report['weight_read_floor_ms']:.1f} ms per step at least")
    for batch, entry in report["batches"].items():
        print(f"batch {batch}: " + ", ".join(f"{key} {value:.1f}" for key, value in entry.items()))


if __name__ == "__main__":
    main()
