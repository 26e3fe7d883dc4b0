"""`make bench-router`: what the router adds, and how long each policy takes to decide.

1. Overhead: the same requests, interleaved, sent directly to gpu_worker and through the router (policy
   gpu_only, so the router picks that same worker after probing both workers with Estimate). TTFT and
   time per output token are compared by median and p99. For scale: the round trip of a routing
   decision alone (Explain) and of one Estimate sent straight to the worker.
2. Decision time of every policy over simulated snapshots of 2, 8 and 64 workers.
3. Footprint: a router's time from process start to SERVING, and its peak and current RSS after 50 routed
   requests (``--only footprint`` runs just this; ``--compare-checkout TREE`` measures another source tree's
   router against the same workers, alternating runs).

Writes bench/results/router.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from router_svc.policy import POLICIES, QueuedWork, RouteInput, WorkerView
from tandem.bench.live import wait_for_healthy_backends
from tandem.bench.results import percentile, write_json
from tandem.v1 import common_pb2, router_pb2, worker_pb2

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def _timed_stream(responses) -> tuple[float, float]:
    """(TTFT, time per output token after the first) of one streamed generation."""
    start = time.perf_counter()
    token_times = []
    for response in responses:
        if response.token_ids:
            token_times.extend([time.perf_counter()] * len(response.token_ids))
    ttft = token_times[0] - start
    return ttft, (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def _timed_call(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def measure_overhead(count: int, max_new_tokens: int) -> dict:
    from tandem.engine.model.loader import resolve_model
    from tandem.stack import start_stack
    from tandem.v1 import router_pb2_grpc, worker_pb2_grpc

    stack = start_stack(str(resolve_model(None)), RESULTS / "router-logs")
    try:
        stack.wait_for_health()
        router = router_pb2_grpc.RouterStub(stack.router.channel)
        worker = worker_pb2_grpc.WorkerStub(stack.gpu.channel)
        asyncio.run(wait_for_healthy_backends(stack.router.address))
        rng = random.Random(0)
        prompt = [rng.randrange(10, 40000) for _ in range(64)]
        sampling = common_pb2.SamplingParams(temperature=0.0)
        ids = worker_pb2.TokenIds(ids=prompt)
        direct_request = worker_pb2.GenerateRequest(prompt_token_ids=ids, max_new_tokens=max_new_tokens,
                                                    sampling=sampling, ignore_eos=True)
        routed_request = router_pb2.RouteRequest(prompt_token_ids=ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                                 ignore_eos=True, policy="gpu_only")
        for _ in range(3):  # warm both paths and the prefix cache
            _timed_stream(worker.Generate(direct_request, timeout=60))
            _timed_stream(router.Generate(routed_request, timeout=60))
        explain = router_pb2.ExplainRequest(request=routed_request)
        estimate = worker_pb2.EstimateRequest(prompt_token_ids=prompt)
        round_trips = {"explain": [_timed_call(lambda: router.Explain(explain, timeout=10)) for _ in range(count)],
                       "worker_estimate": [_timed_call(lambda: worker.Estimate(estimate, timeout=10)) for _ in range(count)]}
        direct, routed = [], []
        for index in range(count):
            pair = [(direct, lambda: worker.Generate(direct_request, timeout=60)),
                    (routed, lambda: router.Generate(routed_request, timeout=60))]
            for samples, call in pair if index % 2 == 0 else reversed(pair):
                samples.append(_timed_stream(call()))
    finally:
        stack.stop()

    def stats(samples: list[tuple[float, float]], position: int) -> dict:
        values = [s[position] * 1000 for s in samples]
        return {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}

    result = {"requests_each": count, "prompt_tokens": 64, "max_new_tokens": max_new_tokens,
              "round_trip": {name: {"p50_ms": percentile(samples, 50), "p99_ms": percentile(samples, 99)}
                             for name, samples in round_trips.items()}}
    for name, position in (("ttft", 0), ("tpot", 1)):
        direct_stats, routed_stats = stats(direct, position), stats(routed, position)
        result[name] = {"direct": direct_stats, "routed": routed_stats,
                        "added_p50_ms": routed_stats["p50_ms"] - direct_stats["p50_ms"],
                        "added_p99_ms": routed_stats["p99_ms"] - direct_stats["p99_ms"]}
    return result


def snapshot(num_workers: int, seed: int = 0) -> list[WorkerView]:
    """Busy workers: a quarter are GPUs with 4 running and a few waiting, the rest CPUs with 1-2 running."""
    rng = random.Random(seed)
    views = []
    for index in range(num_workers):
        gpu = index % 4 == 0
        running = 4 if gpu else rng.randint(1, 2)
        waiting = rng.randint(0, 4) if gpu else 0
        queue = tuple(QueuedWork(True, 0, rng.randint(1, 128)) for _ in range(running))
        queue += tuple(QueuedWork(False, 20, 128) for _ in range(waiting))
        views.append(WorkerView(
            name=f"{'gpu' if gpu else 'cpu'}-{index}", kind="gpu" if gpu else "cpu", cached_tokens=496,
            max_active_requests=4, prefill_tok_s=2551.0 if gpu else 73.0, decode_tok_s=293.0 if gpu else 45.0,
            step_base_s=0.0029 if gpu else 0.0187, step_per_prefill_token_s=0.00039 if gpu else 0.0137,
            step_per_decode_s=0.0027 if gpu else 0.0176, queue=queue))
    return views


def measure_decisions(repeats: int) -> dict:
    request = RouteInput(prompt_tokens=516, max_new_tokens=128)
    result = {}
    for num_workers in (2, 8, 64):
        views = snapshot(num_workers)
        for name, decide in POLICIES.items():
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                decide(views, request)
                samples.append((time.perf_counter() - start) * 1e6)
            result.setdefault(name, {})[str(num_workers)] = {"p50_us": percentile(samples, 50),
                                                             "p99_us": percentile(samples, 99)}
    return result


def measure_footprint(requests: int, runs: int = 1, checkouts: tuple[Path, ...] = ()) -> dict:
    """The router's start-up time and memory: seconds from process start to health SERVING, then peak
    and current RSS after ``requests`` routed requests (half chats, half plain text, so the tokenizer works).

    Once a stack is up, a second router with the stack router's command line, on a free port and over
    the same workers, is started and stopped ``runs`` times. ``checkouts`` are other source trees whose
    router is measured the same way (run with PYTHONPATH set to the tree), alternating with this one's.
    """
    from tandem.engine.model.loader import resolve_model
    from tandem.stack import start_stack

    trees = [ROOT, *checkouts]
    samples: dict[Path, list[dict]] = {tree: [] for tree in trees}
    stack = start_stack(str(resolve_model(None)), RESULTS / "router-logs")
    try:
        stack.wait_for_health()
        asyncio.run(wait_for_healthy_backends(stack.router.address))
        for run in range(runs):
            for index, tree in enumerate(trees):
                log_path = RESULTS / "router-logs" / f"router-footprint-{run}-{index}.log"
                samples[tree].append(_router_footprint(stack.router.args, tree, requests, log_path))
    finally:
        stack.stop()

    def summary(measured: list[dict]) -> dict:
        medians = {key: percentile([m[key] for m in measured], 50)
                   for key in ("time_to_serving_s", "peak_rss_mib", "rss_mib")}
        return {**medians, "imports_torch": any(m["imports_torch"] for m in measured), "runs": measured}

    result = {"requests": requests, **summary(samples[ROOT])}
    if checkouts:
        result["compared"] = {str(tree): summary(samples[tree]) for tree in checkouts}
    return result


def _router_footprint(router_args: list[str], tree: Path, requests: int, log_path: Path) -> dict:
    """Start ``python -m router_svc`` from ``tree``, time it to SERVING, route ``requests``, read its memory."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.launch import SERVING, ServiceProcess
    from tandem.v1 import router_pb2_grpc

    # -P: the working directory does not shadow PYTHONPATH, so the router runs from ``tree``.
    start = time.perf_counter()
    router = ServiceProcess("router-footprint", None, router_args, log_path,
                            command=[sys.executable, "-P", "-m", "router_svc"], env={"PYTHONPATH": str(tree)})
    # Reconnect within 50 ms (not gRPC's default backoff of 1 s and more), so SERVING is seen when it happens.
    channel = grpc.insecure_channel(router.address, options=[
        ("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
        ("grpc.max_reconnect_backoff_ms", 50)])
    try:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if not router.alive:
                raise RuntimeError(f"the router exited with code {router.process.returncode}; log:\n{router.log()}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING:
                    break
            except grpc.RpcError:
                pass
            if time.perf_counter() - start > 300:
                raise TimeoutError(f"the router was not SERVING within 300 s; log:\n{router.log()}")
            time.sleep(0.01)
        time_to_serving_s = time.perf_counter() - start
        stub = router_pb2_grpc.RouterStub(channel)
        sampling = common_pb2.SamplingParams(temperature=0.0)
        for index in range(requests):
            question = f"Question {index}: why is the sky blue?"
            chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=question)])
            prompt = {"prompt_text": question} if index % 2 else {"chat": chat}
            request = router_pb2.RouteRequest(**prompt, max_new_tokens=4, sampling=sampling, ignore_eos=True)
            for _ in stub.Generate(request, timeout=60):
                pass
        proc = Path(f"/proc/{router.process.pid}")
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        imports_torch = "libtorch" in (proc / "maps").read_text()
    finally:
        channel.close()
        router.terminate()
    kib = {key: int(status[key].split()[0]) for key in ("VmHWM", "VmRSS")}
    return {"time_to_serving_s": time_to_serving_s, "peak_rss_mib": kib["VmHWM"] / 1024, "rss_mib": kib["VmRSS"] / 1024,
            "imports_torch": imports_torch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests on each path")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--decision-repeats", type=int, default=2000)
    parser.add_argument("--only", choices=["footprint"],
                        help="run only this part, into bench/results/router-footprint.json")
    parser.add_argument("--footprint-requests", type=int, default=50, help="routed requests before RSS is read")
    parser.add_argument("--footprint-runs", type=int, default=1, help="router starts measured (medians reported)")
    parser.add_argument("--compare-checkout", type=Path, action="append", default=[], metavar="TREE",
                        help="also measure the router of this source tree, alternating with this one (repeatable)")
    args = parser.parse_args()
    report = {}
    if args.only is None:
        report["decision_time"] = measure_decisions(args.decision_repeats)
        report["overhead"] = measure_overhead(args.requests, args.max_new_tokens)
    report["router_footprint"] = measure_footprint(args.footprint_requests, args.footprint_runs,
                                                   tuple(path.resolve() for path in args.compare_checkout))
    output = RESULTS / ("router-footprint.json" if args.only else "router.json")
    write_json(output, report)
    if args.only is None:
        overhead = report["overhead"]
        print(f"TTFT direct p50 {overhead['ttft']['direct']['p50_ms']:.2f} ms, routed p50 "
              f"{overhead['ttft']['routed']['p50_ms']:.2f} ms: added p50 {overhead['ttft']['added_p50_ms']:.2f} ms, "
              f"p99 {overhead['ttft']['added_p99_ms']:.2f} ms")
        print(f"Explain (probes + decision) p50 {overhead['round_trip']['explain']['p50_ms']:.2f} ms; one Estimate "
              f"straight to the worker p50 {overhead['round_trip']['worker_estimate']['p50_ms']:.2f} ms")
        print(f"TPOT added p50 {overhead['tpot']['added_p50_ms']:.3f} ms, "
              f"p99 {overhead['tpot']['added_p99_ms']:.3f} ms")
        sizes = ("2 workers", "8 workers", "64 workers")
        print(f"{'policy':<14}" + "".join(f"{n:>12}" for n in sizes) + "   (p50 µs)")
        for name, by_size in report["decision_time"].items():
            print(f"{name:<14}" + "".join(f"{by_size[n]['p50_us']:>12.1f}" for n in ("2", "8", "64")))
    footprint = report["router_footprint"]
    for tree, measured in [(str(ROOT), footprint), *footprint.get("compared", {}).items()]:
        print(f"router ({tree}): SERVING {measured['time_to_serving_s']:.2f} s after start; after "
              f"{footprint['requests']} routed requests peak RSS {measured['peak_rss_mib']:.0f} MiB, RSS "
              f"{measured['rss_mib']:.0f} MiB; torch {'loaded' if measured['imports_torch'] else 'not loaded'} "
              f"(median of {len(measured['runs'])})")
    print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
