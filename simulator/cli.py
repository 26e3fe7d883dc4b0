"""`tandem sim`: run a workload through a routing policy over simulated workers."""

from __future__ import annotations

import argparse
import json
import sys

from router_svc.policies import DEFAULT_POLICY, POLICIES
from simulator.profiles import PROFILES, fetch_worker_profiles
from simulator.simulator import simulate
from tandem.loadgen.results import records_json
from tandem.loadgen.workloads import add_workload_arguments, build_workload

DEFAULT_VOCAB_SIZE = 32000  # token ids only key the prefix cache in simulation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem sim",
        description="Simulate routing: the router's real policy and the engine's real scheduler, with step times "
                    "from a linear model per worker.")
    source = parser.add_argument_group("workers")
    source.add_argument("--profile", choices=sorted(PROFILES), default="seed-m2",
                        help="named hardware profile: one GPU worker plus --cpu-workers CPU workers")
    source.add_argument("--fit-from", action="append", default=[], metavar="NAME=KIND@HOST:PORT",
                        help="simulate these running workers instead, each with the step model it fitted to its "
                             "own calibration, its limits and its KV blocks (repeatable)")
    source.add_argument("--cpu-workers", type=int, default=1)
    source.add_argument("--gpu-max-active", type=int, default=None, help="the GPU worker's max active requests")
    parser.add_argument("--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY)
    add_workload_arguments(parser)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--decisions", action="store_true", help="with --json: include every decision and request")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cpu_workers < 0:
        parser.error("--cpu-workers must be >= 0")
    if args.gpu_max_active is not None and args.gpu_max_active <= 0:
        parser.error("--gpu-max-active must be > 0")
    try:
        workload = build_workload(args, args.vocab_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.fit_from:
        workers = fetch_worker_profiles(args.fit_from)
        profile_name = "fitted from " + ", ".join(args.fit_from)
    else:
        workers = PROFILES[args.profile]().workers(cpu_workers=args.cpu_workers, gpu_max_active=args.gpu_max_active)
        profile_name = args.profile
    result = simulate(workers, workload, args.policy, keep_decisions=args.decisions)
    summary = result.summary()
    if args.json:
        payload = {"profile": profile_name, "workload": workload.describe(), **summary}
        if args.decisions:
            payload["decisions"] = [
                {"request_id": req_id, "chosen": d.chosen, "scores": {s.worker: s.score for s in d.scores}}
                for req_id, d in result.decisions
            ]
            payload["requests"] = records_json(result.records)
        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        print(format_summary(profile_name, workload.describe(), summary))
    return 0


def format_summary(profile: str, workload: dict, summary: dict) -> str:
    def ms(key: str) -> str:
        value = summary[key]
        return "-" if value is None else f"{value * 1000:.0f} ms"

    lines = [
        f"profile {profile}; workload {workload['name']} with {workload['num_requests']} requests; "
        f"policy {summary['policy']}",
        f"makespan {summary['makespan_s']:.3f} s, output {summary['output_tok_s']:.1f} tok/s, "
        f"outcomes {summary['outcomes']}",
        f"TTFT p50 {ms('ttft_p50_s')}, p95 {ms('ttft_p95_s')}, p99 {ms('ttft_p99_s')}; "
        f"TPOT p50 {ms('tpot_p50_s')}; end-to-end p50 {ms('e2e_p50_s')}, p95 {ms('e2e_p95_s')}",
        "requests per worker: " + ", ".join(f"{name} {count}" for name, count in summary["requests_per_worker"].items()),
    ]
    return "\n".join(lines)
