"""Where a decode step's time goes on a GPU: milliseconds per step at several batch sizes, eager and
replayed from CUDA graphs, against the step's GPU kernel time from the profiler (eager).

A step that takes about as long at batch 1 as at batch 64, and far longer than its kernels, is bound
by launches and Python, not by the GPU. Writes decode-step.json (and the profiler's table) into the
directory given.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

import torch

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.model.factory import build_engine
from tandem.engine.request import Request
from tandem.sampling import SamplingParams

TIMED_STEPS = 32
BATCHES = (1, 8, 64)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def decode_steps(engine, batch: int, tag: str, profile=None) -> float:
    """Milliseconds per decode step with ``batch`` requests running, prompts already prefilled."""
    rng = random.Random(batch)
    for index in range(batch):
        prompt = [rng.randrange(3, engine.executor.vocab_size) for _ in range(64)]
        engine.add_request(Request(f"{tag}-{index}", prompt, TIMED_STEPS + 8, SamplingParams(temperature=0),
                                   ignore_eos=True))
    for _ in range(4):  # prefill, then a few decodes before timing
        engine.step()
    synchronize(engine.executor.device)
    if profile:
        profile.start()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    synchronize(engine.executor.device)
    elapsed = time.perf_counter() - start
    if profile:
        profile.stop()
    while engine.has_work():
        engine.step()
    return elapsed * 1000 / TIMED_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    on_cuda = args.device.startswith("cuda")
    report: dict = {"device": torch.cuda.get_device_name(args.device) if on_cuda else args.device}

    def write() -> None:
        (args.out_dir / "decode-step.json").write_text(json.dumps(report, indent=2) + "\n")

    def engine_with(cuda_graphs: bool):
        engine = build_engine(args.model, args.device, scheduler=SchedulerConfig(max_active_requests=64,
                              max_num_batched_tokens=4096), cache=CacheConfig(num_kv_blocks=2048), calibrate=False,
                              cuda_graphs=cuda_graphs)
        started = time.perf_counter()
        for batch in BATCHES:  # warm-up, and the graphs' capture, outside the timed steps
            decode_steps(engine, batch, f"warmup{batch}")
        return engine, time.perf_counter() - started

    engine, _ = engine_with(False)
    runner = engine.executor
    report |= {"dtype": str(runner.dtype),
               "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
               "ms_per_step": {batch: decode_steps(engine, batch, f"b{batch}") for batch in BATCHES}}
    write()

    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])])
    decode_steps(engine, 1, "profiled", profiler)
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    report["batch1_kernels_per_step"] = len(kernels) / TIMED_STEPS
    report["batch1_kernel_ms_per_step"] = sum(e.time_range.elapsed_us() for e in kernels) / 1000 / TIMED_STEPS
    (args.out_dir / "decode-step-profile.txt").write_text(
        profiler.key_averages().table(sort_by="self_device_time_total", row_limit=25))
    write()
    del engine, runner

    try:
        graphs_engine, warmup_s = engine_with(True)
        report["cuda_graphs_warmup_and_capture_s"] = warmup_s
        report["cuda_graph_shapes"] = sorted(graphs_engine.executor.decode_graphs.shapes)
        report["ms_per_step_cuda_graphs"] = {batch: decode_steps(graphs_engine, batch, f"g{batch}")
                                             for batch in BATCHES}
    except Exception:  # the eager figures above still stand
        report["cuda_graphs_error"] = traceback.format_exc()
    write()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
