"""`make bench-seed`: the article's experiment, in simulation (profile seed-m2) and live on this machine,
and its open questions answered in simulation.

Writes bench/results/seed.json, bench/results/seed.md and PNG plots beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from simulator.profiles import fetch_worker_profiles, seed_m2
from simulator.simulator import simulate
from tandem.loadgen import plots
from tandem.loadgen.live import (router_workers, run_workload, wait_for_healthy_backends, warm, worker_vocab_size,
                               write_run)
from tandem.loadgen.results import write_json
from tandem.loadgen.workloads import long_context, seed_burst
from tandem.engine.utils import cdiv

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (4, 8, 48)
MAX_ACTIVE_SWEEP = (1, 2, 4, 8, 16, 32)
SIM_VOCAB = 32000
ROW_KEYS = ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s", "offloaded_to_cpu")


def row(summary: dict, **labels) -> dict:
    return {**labels, **{key: summary[key] for key in ROW_KEYS}}


def sim(profile, workload, policy: str, cpu_workers: int = 1, gpu_max_active: int | None = None) -> dict:
    workers = profile.workers(cpu_workers=cpu_workers, gpu_max_active=gpu_max_active)
    summary = simulate(workers, workload, policy).summary()
    assert summary["outcomes"] == {"OK": len(workload.requests)}, summary["outcomes"]
    return row(summary, policy=policy, cpu_workers=cpu_workers if policy != "gpu_only" else 0,
               gpu_max_active=gpu_max_active or profile.gpu.scheduler.max_active_requests)


def best(rows: list[dict]) -> dict:
    return min(rows, key=lambda r: r["makespan_s"])


def tuned(profile, workload, policy: str, cpu_workers: int = 1) -> tuple[dict, list[dict]]:
    """The best makespan over the GPU max_active sweep, and the sweep."""
    sweep = [sim(profile, workload, policy, cpu_workers, k) for k in MAX_ACTIVE_SWEEP]
    return best(sweep), sweep


def gain(baseline: dict, candidate: dict) -> float:
    """Relative makespan reduction of ``candidate`` against ``baseline`` (positive: candidate is faster)."""
    return 1 - candidate["makespan_s"] / baseline["makespan_s"]


def simulation_report(fixed_share_sensitivity: float) -> dict:
    profile = seed_m2()
    report: dict = {"profile": profile.name, "description": profile.description}

    article = []
    for n in SIZES:
        workload = seed_burst(n, SIM_VOCAB)
        gpu4 = sim(profile, workload, "gpu_only", gpu_max_active=4)
        cost4 = sim(profile, workload, "cost", gpu_max_active=4)
        finish4 = sim(profile, workload, "finish_time", gpu_max_active=4)
        article.append({"requests": n, "gpu_only@4": gpu4, "cost@4": cost4, "finish_time@4": finish4,
                        "cost_gain_vs_gpu_only@4": gain(gpu4, cost4)})
    report["article_setup"] = article

    q1, sweeps = [], {}
    for n in SIZES:
        workload = seed_burst(n, SIM_VOCAB)
        gpu_best, gpu_sweep = tuned(profile, workload, "gpu_only")
        hybrid_best, hybrid_sweep = tuned(profile, workload, "cost")
        q1.append({"requests": n, "best_gpu_only": gpu_best, "best_cost": hybrid_best,
                   "gain_vs_best_gpu_only": gain(gpu_best, hybrid_best)})
        sweeps[n] = {"gpu_only": gpu_sweep, "cost": hybrid_sweep}
    report["q1_tuned_gpu_only"] = q1
    report["q1_sweeps"] = sweeps
    membound = seed_m2(fixed_share=fixed_share_sensitivity)
    workload = seed_burst(48, SIM_VOCAB)
    gpu_best, _ = tuned(membound, workload, "gpu_only")
    hybrid_best, _ = tuned(membound, workload, "cost")
    finish_best, _ = tuned(membound, workload, "finish_time")
    report["q1_sensitivity"] = {"fixed_share": fixed_share_sensitivity, "requests": 48, "best_gpu_only": gpu_best,
                                "best_cost": hybrid_best, "gain_vs_best_gpu_only": gain(gpu_best, hybrid_best),
                                "best_finish_time": finish_best, "finish_time_gain": gain(gpu_best, finish_best)}

    q2 = []
    for n in SIZES:
        workload = seed_burst(n, SIM_VOCAB)
        cost_best, _ = tuned(profile, workload, "cost")
        finish_best, _ = tuned(profile, workload, "finish_time")
        q2.append({"requests": n, "cost@4": sim(profile, workload, "cost", gpu_max_active=4),
                   "finish_time@4": sim(profile, workload, "finish_time", gpu_max_active=4),
                   "best_cost": cost_best, "best_finish_time": finish_best})
    report["q2_finish_time_vs_cost"] = q2

    q3 = []
    for hit in (0.0, 0.5, 0.9, 496 / 516):
        for output_fraction in (1.0, 0.5):
            workload = seed_burst(48, SIM_VOCAB, prefix_tokens=round(hit * 516), output_fraction=output_fraction)
            gpu_best, _ = tuned(profile, workload, "gpu_only")
            entry = {"cache_hit": hit, "output_fraction": output_fraction, "best_gpu_only": gpu_best}
            for policy in ("cost", "finish_time"):
                entry[f"best_{policy}"], _ = tuned(profile, workload, policy)
                entry[f"{policy}_gain"] = gain(gpu_best, entry[f"best_{policy}"])
            q3.append(entry)
    report["q3_cache_hit_and_output_length"] = q3

    q4 = []
    for n in (8, 48):
        workload = seed_burst(n, SIM_VOCAB)
        gpu_best, _ = tuned(profile, workload, "gpu_only")
        for cpus in (1, 2, 4):
            hybrid_best, _ = tuned(profile, workload, "cost", cpu_workers=cpus)
            finish_best, _ = tuned(profile, workload, "finish_time", cpu_workers=cpus)
            q4.append({"requests": n, "cpu_workers": cpus, "best_gpu_only": gpu_best, "best_cost": hybrid_best,
                       "best_finish_time": finish_best, "cost_gain": gain(gpu_best, hybrid_best),
                       "finish_time_gain": gain(gpu_best, finish_best)})
    report["q4_cpu_workers"] = q4

    q5 = []
    for warmed in (False, True):
        for context in (2048, 4096, 8192, 16384, 32768):
            workload = long_context(48, SIM_VOCAB, context_tokens=context, warmed=warmed)
            gpu_best, _ = tuned(profile, workload, "gpu_only")
            entry = {"context_tokens": context, "warmed": warmed, "gpu_kv_tokens": profile.gpu.num_kv_blocks * 16,
                     "gpu_requests_that_fit": profile.gpu.num_kv_blocks // cdiv(context + 20 + 128, 16),
                     "best_gpu_only": gpu_best}
            for policy in ("cost", "finish_time"):
                entry[f"best_{policy}"], _ = tuned(profile, workload, policy)
                entry[f"{policy}_gain"] = gain(gpu_best, entry[f"best_{policy}"])
            q5.append(entry)
    report["q5_long_context"] = q5
    return report


def live_report(sizes: list[int], repeats: int, policies: list[str]) -> dict:
    """Each run on fresh servers (default model) with the shared prefix warmed on both workers."""
    from tandem.model_files import resolve_model

    model = str(resolve_model(None))
    runs: dict = {}
    for n in sizes:
        for policy in policies:
            for repeat in range(repeats):
                entry = live_run(model, n, policy, repeat, RESULTS / "seed-live", plot=repeat == 0)
                runs.setdefault(n, {}).setdefault(policy, []).append(entry)
    means = {n: {policy: {key: statistics.mean(r[key] for r in rows) for key in ROW_KEYS}
                 for policy, rows in by_policy.items()} for n, by_policy in runs.items()}
    return {"model": model, "repeats": repeats, "runs": runs, "means": means}


def live_run(model: str, n: int, policy: str, repeat: int, out_dir: Path, gpu_max_active: int = 4,
             cpu_max_active: int = 4, plot: bool = False) -> dict:
    """One seed-burst run on a fresh stack; its full record goes to ``out_dir``, its summary row is returned
    with the simulator's prediction for the same workload from the step models the workers fitted."""
    from tandem.stack import start_stack

    stack = start_stack(model, out_dir / "logs", cpu_args=("--max-active", str(cpu_max_active)),
                        gpu_args=("--max-active", str(gpu_max_active)))
    try:
        stack.wait_for_health()
        run, workload, fitted = asyncio.run(_live_run(stack, n, policy, repeat))
    finally:
        stack.stop()
    label = f"live-{n}-{policy}-gpu{gpu_max_active}-{repeat}"
    summary = write_run(run, workload, out_dir / f"{label}.json", plot=plot)
    entry = row(summary, policy=policy, repeat=repeat, gpu_max_active=gpu_max_active)
    entry["requests_per_worker"] = summary["requests_per_worker"]
    entry["simulated_with_fitted_workers"] = row(simulate(fitted, workload, policy).summary(), policy=policy)
    print(f"  live N={n} {policy} gpu max_active {gpu_max_active} #{repeat}: makespan {entry['makespan_s']:.2f} s "
          f"(simulated {entry['simulated_with_fitted_workers']['makespan_s']:.2f} s), "
          f"per worker {entry['requests_per_worker']}", flush=True)
    return entry


async def _live_run(stack, n: int, policy: str, repeat: int):
    address = stack.router.address
    await wait_for_healthy_backends(address)
    workers = await router_workers(address)
    fitted = fetch_worker_profiles([f"{w.name}={w.kind}@{w.address}" for w in workers])
    workload = seed_burst(n, await worker_vocab_size(workers[0].address), seed=repeat)
    await warm(workers, workload.warm_prefixes)
    run = await run_workload(address, workload, workers, via_router=True, policy=policy, label=policy)
    return run, workload, fitted


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(str(cell) for cell in r) + " |" for r in rows)]


def _cells(r: dict) -> list[str]:
    return [_s(r["makespan_s"]), f"{r['output_tok_s']:.0f}", _s(r["ttft_p50_s"]), _s(r["ttft_p95_s"]),
            str(r["offloaded_to_cpu"])]


def render_markdown(report: dict) -> str:
    sim = report["simulation"]
    out = ["# Seed experiment: cost-based CPU offload versus GPU-only", "",
           f"Simulation profile `{sim['profile']}`: {sim['description']}. Makespan and TTFT in seconds, "
           "throughput in output tokens/s, offload = requests sent to CPU workers. Gain = makespan reduction "
           "against the baseline named.", "",
           "## The article's setup (seed-burst, both workers at 4 active)", ""]
    rows = []
    for entry in sim["article_setup"]:
        for name in ("gpu_only@4", "cost@4", "finish_time@4"):
            rows.append([entry["requests"], name, *_cells(entry[name])])
    out += _table(["N", "policy", "makespan", "tok/s", "TTFT p50", "TTFT p95", "offload"], rows)
    out += ["", "## 1. Hybrid against the best-tuned GPU-only (GPU max_active swept 1..32 for both)", ""]
    out += _table(["N", "best GPU-only (max_active)", "best cost (GPU max_active)", "gain"],
                  [[e["requests"], f"{_s(e['best_gpu_only']['makespan_s'])} ({e['best_gpu_only']['gpu_max_active']})",
                    f"{_s(e['best_cost']['makespan_s'])} ({e['best_cost']['gpu_max_active']})",
                    _pct(e["gain_vs_best_gpu_only"])] for e in sim["q1_tuned_gpu_only"]])
    sens = sim["q1_sensitivity"]
    out += ["", f"Sensitivity: with a fixed step share of {sens['fixed_share']} (batching nearly free on the GPU), "
            f"N=48: best GPU-only {_s(sens['best_gpu_only']['makespan_s'])} s at max_active "
            f"{sens['best_gpu_only']['gpu_max_active']}, best cost {_s(sens['best_cost']['makespan_s'])} s, gain "
            f"{_pct(sens['gain_vs_best_gpu_only'])}; best finish_time {_s(sens['best_finish_time']['makespan_s'])} s, "
            f"gain {_pct(sens['finish_time_gain'])}.", "",
            "## 2. finish_time against cost", ""]
    out += _table(["N", "cost@4", "finish_time@4", "best cost", "best finish_time"],
                  [[e["requests"], *(f"{_s(e[k]['makespan_s'])} ({e[k]['offloaded_to_cpu']} off)"
                                     for k in ("cost@4", "finish_time@4", "best_cost", "best_finish_time"))]
                   for e in sim["q2_finish_time_vs_cost"]])
    out += ["", "## 3. Cache-hit ratio and outputs shorter than max_new_tokens (N=48, each against the best GPU-only)", ""]
    out += _table(["cache hit", "mean output / budget", "best GPU-only", "best cost", "cost gain", "best finish_time",
                   "finish_time gain"],
                  [[f"{100 * e['cache_hit']:.0f}%", e["output_fraction"], _s(e["best_gpu_only"]["makespan_s"]),
                    _s(e["best_cost"]["makespan_s"]), _pct(e["cost_gain"]), _s(e["best_finish_time"]["makespan_s"]),
                    _pct(e["finish_time_gain"])] for e in sim["q3_cache_hit_and_output_length"]])
    out += ["", "## 4. One GPU plus 1, 2 or 4 CPU workers (against the best GPU-only)", ""]
    out += _table(["N", "CPU workers", "best GPU-only", "best cost", "cost gain", "best finish_time", "finish_time gain"],
                  [[e["requests"], e["cpu_workers"], _s(e["best_gpu_only"]["makespan_s"]), _s(e["best_cost"]["makespan_s"]),
                    _pct(e["cost_gain"]), _s(e["best_finish_time"]["makespan_s"]), _pct(e["finish_time_gain"])]
                   for e in sim["q4_cpu_workers"]])
    out += ["", "## 5. Long contexts whose KV memory caps the GPU (48 requests, unique contexts, 128 new tokens)", "",
            "Warmed: each context is a history computed on every worker beforehand (as far as each cache holds "
            "it) and the prompt adds a 20-token turn; otherwise every context is prefilled.", ""]
    out += _table(["warmed", "context", "GPU KV tokens", "fit on GPU", "best GPU-only", "best cost", "cost gain",
                   "best finish_time", "finish_time gain"],
                  [[e["warmed"], e["context_tokens"], e["gpu_kv_tokens"], e["gpu_requests_that_fit"],
                    f"{_s(e['best_gpu_only']['makespan_s'])} ({e['best_gpu_only']['gpu_max_active']})",
                    f"{_s(e['best_cost']['makespan_s'])} ({e['best_cost']['offloaded_to_cpu']} off)", _pct(e["cost_gain"]),
                    f"{_s(e['best_finish_time']['makespan_s'])} ({e['best_finish_time']['offloaded_to_cpu']} off)",
                    _pct(e["finish_time_gain"])] for e in sim["q5_long_context"]])
    live = report.get("live")
    if live:
        out += ["", f"## Live on this machine ({live['repeats']} runs each, fresh servers, mean; model {live['model']})", "",
                "Both workers run on this machine's CPU cores (gpu_worker with --device cpu): this measures the "
                "mechanics (decisions, cache reuse, overheads), not a GPU. 'sim' is the simulator run with the step "
                "models these workers fitted at start-up, on the same workload.", ""]
        rows = []
        for n, by_policy in live["runs"].items():
            for policy, runs in by_policy.items():
                mean = live["means"][n][policy]
                simulated = statistics.mean(r["simulated_with_fitted_workers"]["makespan_s"] for r in runs)
                rows.append([n, policy, *_cells({**mean, "offloaded_to_cpu": f"{mean['offloaded_to_cpu']:.1f}"}),
                             _s(simulated)])
        out += _table(["N", "policy", "makespan", "tok/s", "TTFT p50", "TTFT p95", "offload", "sim makespan"], rows)
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-live", action="store_true", help="simulation only")
    parser.add_argument("--live-sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--live-repeats", type=int, default=3)
    parser.add_argument("--live-policies", nargs="+", default=["cost", "gpu_only"])
    parser.add_argument("--sensitivity-fixed-share", type=float, default=0.8)
    parser.add_argument("--live-only", action="store_true",
                        help="only the live runs, each beside the simulator's prediction: bench/results/seed-live.json")
    args = parser.parse_args()
    if args.live_only:
        live = live_report(args.live_sizes, args.live_repeats, args.live_policies)
        write_json(RESULTS / "seed-live.json", live)
        print(f"wrote {RESULTS / 'seed-live.json'}", file=sys.stderr)
        return 0

    started = time.perf_counter()
    report = {"simulation": simulation_report(args.sensitivity_fixed_share)}
    report["simulation_seconds"] = time.perf_counter() - started
    sweeps = report["simulation"]["q1_sweeps"]
    plots.lines({f"{policy}, N={n}": [(r["gpu_max_active"], r["makespan_s"]) for r in sweeps[n][policy]]
                 for n in (8, 48) for policy in ("gpu_only", "cost")},
                RESULTS / "seed-sweep.png", "GPU max_active", "makespan (s)",
                "seed-m2 (simulated): makespan against the GPU's max_active", log_x=True)
    profile = seed_m2()
    for policy in ("gpu_only", "cost"):
        result = simulate(profile.workers(), seed_burst(48, SIM_VOCAB), policy)
        plots.timeline(result.records, RESULTS / f"seed-sim-48-{policy}-timeline.png",
                       f"seed-m2 (simulated), seed-burst 48, {policy}")
    if not args.no_live:
        report["live"] = live_report(args.live_sizes, args.live_repeats, args.live_policies)
    write_json(RESULTS / "seed.json", report)
    (RESULTS / "seed.md").write_text(render_markdown(report))
    print((RESULTS / "seed.md").read_text())
    print(f"wrote {RESULTS / 'seed.json'} and {RESULTS / 'seed.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
