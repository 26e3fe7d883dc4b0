"""`make bench-hybrid`: the router over a Tandem cpu_worker and a gpu_worker that runs vLLM (``--engine vllm``).

``finish_time`` (both workers) against ``gpu_only`` (the vLLM worker alone), with the vLLM worker's
``max_num_seqs`` (``--max-active``) swept over 4, 8, 16 and 32, on three loads: the article's seed-burst at
N = 8 and N = 48, and Poisson arrivals at 80% of the vLLM worker's capacity. Each setting gets one fresh
stack; each run draws its own token ids (the same shapes), so that no run finds another's prompts cached, and
has its shared prefixes warmed on both workers first. Beside each run: the simulator's makespan for the same
workload from the step models the two workers fitted, and its error.

Without CUDA the vLLM worker runs vLLM's CPU build on this machine's cores (``gpu_worker --device cpu``),
the cores split between the two workers: that measures the mechanics, not a GPU.

Writes bench/results/hybrid.json (and each run's record under bench/results/hybrid/).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from simulator.profiles import fetch_worker_profiles
from simulator.simulator import simulate
from tandem.loadgen.live import router_workers, run_workload, wait_for_healthy_backends, warm, worker_vocab_size, write_run
from tandem.loadgen.results import write_json
from tandem.loadgen.workloads import Workload, poisson, seed_burst

RESULTS = Path(__file__).resolve().parent / "results"
MAX_NUM_SEQS = (4, 8, 16, 32)
POLICIES = ("gpu_only", "finish_time")
POISSON_REQUESTS = 48
POISSON_LOAD = 0.8
TARGET_WORSE = 0.01  # tuned finish_time may be at most 1% slower than tuned gpu_only
ROW_KEYS = ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "offloaded_to_cpu",
            "requests_per_worker", "outcomes")


def loads(vocab_size: int, seed: int, poisson_rate: float | None) -> dict[str, Workload]:
    named = {"seed-burst-8": seed_burst(8, vocab_size, seed=seed), "seed-burst-48": seed_burst(48, vocab_size, seed=seed)}
    if poisson_rate is not None:
        named["poisson-80%"] = poisson(POISSON_REQUESTS, vocab_size, seed=seed, rate_per_s=poisson_rate)
    return named


def gpu_capacity(fitted: dict, vocab_size: int) -> float:
    """Requests per second the vLLM worker alone sustains on the Poisson load's shapes, by the simulator from its
    fitted step model: the whole load arriving at once, divided by its makespan."""
    burst = poisson(POISSON_REQUESTS, vocab_size, rate_per_s=1e6)
    return POISSON_REQUESTS / simulate(fitted, burst, "gpu_only").summary()["makespan_s"]


async def run_setting(stack, max_num_seqs: int, out_dir: Path, poisson_rate: float | None, seeds) -> tuple[list, float]:
    """Every load under both policies on one stack; the rows and the Poisson rate used."""
    address = stack.router.address
    await wait_for_healthy_backends(address)
    workers = await router_workers(address)
    specs = [f"{w.name}={w.kind}@{w.address}" for w in workers]
    vocab_size = await worker_vocab_size(workers[0].address)
    if poisson_rate is None:
        poisson_rate = POISSON_LOAD * gpu_capacity(fetch_worker_profiles(specs), vocab_size)
        print(f"  Poisson load: {poisson_rate:.3f} requests/s ({POISSON_LOAD:.0%} of the vLLM worker's capacity "
              f"by its fitted step model at max_num_seqs {max_num_seqs})", flush=True)
    rows = []
    for name in loads(vocab_size, 0, poisson_rate):
        for policy in POLICIES:
            workload = loads(vocab_size, next(seeds), poisson_rate)[name]
            await warm(workers, workload.warm_prefixes)
            fitted = fetch_worker_profiles(specs)
            run = await run_workload(address, workload, workers, via_router=True, policy=policy, label=policy)
            summary = write_run(run, workload, out_dir / f"{name}-{policy}-seqs{max_num_seqs}.json", plot=False)
            simulated = simulate(fitted, workload, policy).summary()["makespan_s"]
            row = {"load": name, "policy": policy, "max_num_seqs": max_num_seqs,
                   **{key: summary[key] for key in ROW_KEYS}, "simulated_makespan_s": simulated,
                   "simulator_error": simulated / summary["makespan_s"] - 1}
            rows.append(row)
            print(f"  {name} {policy} max_num_seqs {max_num_seqs}: makespan {row['makespan_s']:.2f} s "
                  f"(simulated {simulated:.2f} s, {row['simulator_error']:+.1%}), TTFT p50 {row['ttft_p50_s']:.2f} "
                  f"p95 {row['ttft_p95_s']:.2f} s, per worker {row['requests_per_worker']}, {row['outcomes']}",
                  flush=True)
    return rows, poisson_rate


def verdicts(rows: list[dict]) -> list[dict]:
    """Per load: finish_time against gpu_only at each max_num_seqs, and both tuned (the best of the sweep)."""
    out = []
    for name in dict.fromkeys(row["load"] for row in rows):
        runs = {(row["policy"], row["max_num_seqs"]): row["makespan_s"] for row in rows if row["load"] == name}
        settings = sorted({seqs for _, seqs in runs})
        best = {policy: min(settings, key=lambda seqs: runs[policy, seqs]) for policy in POLICIES}
        best_gpu, best_finish = runs["gpu_only", best["gpu_only"]], runs["finish_time", best["finish_time"]]
        out.append({
            "load": name,
            "gain_at_each_max_num_seqs": {seqs: 1 - runs["finish_time", seqs] / runs["gpu_only", seqs]
                                          for seqs in settings},
            "best_gpu_only": {"max_num_seqs": best["gpu_only"], "makespan_s": best_gpu},
            "best_finish_time": {"max_num_seqs": best["finish_time"], "makespan_s": best_finish},
            "tuned_gain": 1 - best_finish / best_gpu,
            "target_met": best_finish <= (1 + TARGET_WORSE) * best_gpu,
        })
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of vLLM's environment (make setup-vllm)")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=list(MAX_NUM_SEQS))
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--output", type=Path, default=RESULTS / "hybrid.json")
    args = parser.parse_args()

    import torch

    from tandem.model_files import resolve_model
    from tandem.stack import start_stack

    model = str(resolve_model(args.model))
    started = time.perf_counter()
    report: dict = {"model": model, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "max_num_seqs": args.max_num_seqs, "rows": []}
    seeds = iter(range(1, 1 << 30))
    poisson_rate = None
    # The largest setting first: the Poisson rate comes from the vLLM worker's capacity at its widest batch.
    for max_num_seqs in sorted(args.max_num_seqs, reverse=True):
        out_dir = args.output.parent / args.output.stem
        stack = start_stack(model, out_dir / f"logs-seqs{max_num_seqs}", cpu_args=("--max-active", "4"),
                            gpu_args=("--engine", "vllm", "--max-active", str(max_num_seqs)),
                            gpu_python=args.vllm_python)
        print(f"max_num_seqs {max_num_seqs}: {stack.notice}", flush=True)
        try:
            stack.wait_for_health()
            rows, poisson_rate = asyncio.run(run_setting(stack, max_num_seqs, out_dir, poisson_rate, seeds))
        finally:
            stack.stop()
        report["rows"] += rows
        report["poisson_rate_per_s"] = poisson_rate
        report["verdicts"] = verdicts(report["rows"])
        report["elapsed_s"] = time.perf_counter() - started
        write_json(args.output, report)
    for verdict in report["verdicts"]:
        at_each = ", ".join(f"{seqs}: {gain:+.1%}" for seqs, gain in verdict["gain_at_each_max_num_seqs"].items())
        print(f"{verdict['load']}: tuned gpu_only {verdict['best_gpu_only']['makespan_s']:.2f} s (max_num_seqs "
              f"{verdict['best_gpu_only']['max_num_seqs']}), tuned finish_time {verdict['best_finish_time']['makespan_s']:.2f} s "
              f"(max_num_seqs {verdict['best_finish_time']['max_num_seqs']}), gain {verdict['tuned_gain']:+.1%}, "
              f"target met: {verdict['target_met']}; gain at each max_num_seqs: {at_each}")
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
