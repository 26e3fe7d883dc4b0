"""`make bench-matrix`: the routing policies against the best-tuned GPU-only setup over a matrix of
scenarios, in simulation (profile seed-m2). Writes bench/results/matrix.json, and matrix.md beside it.

Axes: seed-burst at N = 8 and 48; Poisson arrivals at about 50, 80 and 95% of the hybrid's capacity,
with outputs of 0.3 and 1.0 of the budget and prefix shares 0 and 0.9; long contexts of 2k, 8k, 16k and
32k tokens, cached and uncached; the GPU's fixed step share 0.21 and 0.8; 1 and 4 CPU workers.

In each cell the GPU-only baseline is tuned over GPU max_active in GPU_MAX_ACTIVE, and every policy runs
the hybrid with that same GPU setting. gain = best GPU-only makespan / policy makespan - 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from router_svc.policies import DEFAULT_POLICY
from simulator.profiles import seed_m2
from simulator.simulator import simulate
from tandem.loadgen.workloads import long_context, poisson, seed_burst

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 32000
GPU_MAX_ACTIVE = (4, 8, 16, 32, 64)
POLICIES = ("cost", "finish_time")
FIXED_SHARES = (0.21, 0.8)
CPU_WORKERS = (1, 4)
LOADS = (0.5, 0.8, 0.95)
POISSON_REQUESTS = 96
POISSON_BUDGET = 128
CAPACITY_GPU_MAX_ACTIVE = 16


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    fixed_share: float
    cpu_workers: int
    workload: str  # seed-burst, poisson or long-context
    arguments: tuple[tuple[str, object], ...]
    helpful: bool = False  # a cell where the hybrid is expected to gain (the +8% target)

    def build(self, rate_per_s: float | None = None):
        """The cell's workload; a Poisson cell's at ``rate_per_s`` (its load only sets that rate)."""
        arguments = {name: value for name, value in self.arguments if name != "load"}
        if self.workload == "seed-burst":
            return seed_burst(vocab_size=VOCAB, **arguments)
        if self.workload == "long-context":
            return long_context(vocab_size=VOCAB, **arguments)
        return poisson(vocab_size=VOCAB, rate_per_s=rate_per_s, **arguments)


def cells() -> list[Cell]:
    out = []
    for share, cpus in itertools.product(FIXED_SHARES, CPU_WORKERS):
        where = f"share {share}, {cpus} cpu"
        for n in (8, 48):
            out.append(Cell(f"seed-burst N={n}, {where}", share, cpus, "seed-burst", (("num_requests", n),),
                            helpful=share == 0.21 and n == 48))  # with 1 CPU and with 4
        for load, fraction, prefix_share in itertools.product(LOADS, (0.3, 1.0), (0.0, 0.9)):
            out.append(Cell(f"poisson load {load:.0%}, output {fraction}, prefix {prefix_share}, {where}", share, cpus,
                            "poisson", (("num_requests", POISSON_REQUESTS), ("max_new_tokens", POISSON_BUDGET),
                                        ("output_tokens_mean", round(fraction * POISSON_BUDGET)),
                                        ("prefix_share", prefix_share), ("load", load))))
        for context, warmed in itertools.product((2048, 8192, 16384, 32768), (False, True)):
            out.append(Cell(f"long-context {context // 1024}k {'cached' if warmed else 'uncached'}, {where}", share, cpus,
                            "long-context", (("num_requests", 48), ("context_tokens", context), ("warmed", warmed)),
                            helpful=share == 0.21 and warmed and context in (4096, 8192)))
    return out


def _summary(profile, cpu_workers: int, gpu_max_active: int, workload, policy: str) -> dict:
    workers = profile.workers(cpu_workers=0 if policy == "gpu_only" else cpu_workers, gpu_max_active=gpu_max_active)
    summary = simulate(workers, workload, policy).summary()
    if summary["outcomes"] != {"OK": len(workload.requests)}:
        raise RuntimeError(f"{policy} at GPU max_active {gpu_max_active}: {summary['outcomes']}")
    return {"makespan_s": summary["makespan_s"], "ttft_p95_s": summary["ttft_p95_s"],
            "offloaded_to_cpu": summary["offloaded_to_cpu"], "moves": summary["moves"], "gpu_max_active": gpu_max_active}


def _poisson_rate(cell: Cell, profile) -> float:
    """Requests per second at the cell's load: the load times the hybrid's capacity for this request mix,
    measured as the throughput of the same requests all arriving at once, under the faster policy."""
    burst = cell.build(rate_per_s=1e9)
    makespan = min(_summary(profile, cell.cpu_workers, CAPACITY_GPU_MAX_ACTIVE, burst, policy)["makespan_s"]
                   for policy in POLICIES)
    return dict(cell.arguments)["load"] * len(burst.requests) / makespan


def run_cell(cell: Cell) -> dict:
    profile = seed_m2(fixed_share=cell.fixed_share)
    rate = _poisson_rate(cell, profile) if cell.workload == "poisson" else None
    workload = cell.build(rate)
    sweep = [_summary(profile, cell.cpu_workers, k, workload, "gpu_only") for k in GPU_MAX_ACTIVE]
    gpu_only = min(sweep, key=lambda r: r["makespan_s"])
    by_policy = {}
    for policy in POLICIES:
        result = _summary(profile, cell.cpu_workers, gpu_only["gpu_max_active"], workload, policy)
        result["gain"] = gpu_only["makespan_s"] / result["makespan_s"] - 1
        by_policy[policy] = result
    chosen = by_policy[DEFAULT_POLICY]
    return {"name": cell.name, "policy": DEFAULT_POLICY, "makespan_s": chosen["makespan_s"],
            "best_gpu_only_makespan_s": gpu_only["makespan_s"], "gain": chosen["gain"],
            "ttft_p95_s": chosen["ttft_p95_s"], "best_gpu_only_ttft_p95_s": gpu_only["ttft_p95_s"],
            "gpu_max_active": gpu_only["gpu_max_active"], "offloaded_to_cpu": chosen["offloaded_to_cpu"],
            "helpful": cell.helpful, "fixed_share": cell.fixed_share, "cpu_workers": cell.cpu_workers,
            "workload": cell.workload, "arrival_rate_per_s": rate, "policies": by_policy,
            "gpu_only_sweep": sweep}


def summarize(results: list[dict]) -> dict:
    def stats(gains: list[float]) -> dict:
        return {"min_gain": min(gains), "mean_gain": sum(gains) / len(gains)}

    def helpful_min(policy: str) -> float | None:
        return min((r["policies"][policy]["gain"] for r in results if r["helpful"]), default=None)

    return {
        "policy": DEFAULT_POLICY, **stats([r["gain"] for r in results]), "helpful_min_gain": helpful_min(DEFAULT_POLICY),
        "by_policy": {policy: {**stats([r["policies"][policy]["gain"] for r in results]),
                               "helpful_min_gain": helpful_min(policy)} for policy in POLICIES},
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def render_markdown(report: dict) -> str:
    summary = report["summary"]
    lines = [f"# Routing policies against the best-tuned GPU-only setup (simulated, {report['profile']})", "",
             f"Default policy `{summary['policy']}`: min gain {summary['min_gain']:+.1%}, mean gain "
             f"{summary['mean_gain']:+.1%}, min gain where hybrid can help {_percent(summary['helpful_min_gain'])}.",
             *(f"`{policy}`: min gain {entry['min_gain']:+.1%}, mean {entry['mean_gain']:+.1%}, where hybrid can help "
               f"{_percent(entry['helpful_min_gain'])}." for policy, entry in summary["by_policy"].items()), "",
             "| cell | best GPU-only s (max_active) | " + " | ".join(f"`{p}` gain" for p in report["policies_compared"])
             + " | moves | TTFT p95 s, GPU-only → default |", "|" + " --- |" * (4 + len(report["policies_compared"]))]
    for cell in report["cells"]:
        gains = " | ".join(f"{cell['policies'][p]['gain']:+.1%}" for p in report["policies_compared"])
        lines.append(f"| {cell['name']}{' (can help)' if cell['helpful'] else ''} | "
                     f"{cell['best_gpu_only_makespan_s']:.2f} ({cell['gpu_max_active']}) | {gains} | "
                     f"{cell['policies'][cell['policy']]['moves']} | "
                     f"{cell['best_gpu_only_ttft_p95_s']:.2f} → {cell['ttft_p95_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="cells simulated at once")
    parser.add_argument("--only", default="", help="run only the cells whose name contains this")
    args = parser.parse_args()
    chosen = [cell for cell in cells() if args.only in cell.name]
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        results = []
        for result in pool.map(run_cell, chosen):
            results.append(result)
            print(f"{result['gain']:+7.1%}  {result['name']}  (" + ", ".join(
                f"{p} {r['gain']:+.1%}" for p, r in result["policies"].items()) + ")", flush=True)
    report = {"profile": "seed-m2", "gpu_max_active_tuned_over": list(GPU_MAX_ACTIVE),
              "policies_compared": list(POLICIES), "cells": results, "summary": summarize(results),
              "seconds": time.perf_counter() - started}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("matrix.json" if not args.only else "matrix-partial.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(render_markdown(report))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
