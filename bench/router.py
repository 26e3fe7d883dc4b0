"""`make bench-router`: what the router adds, and how long each policy takes to decide.

1. Overhead: the same requests, interleaved, sent directly to gpu_worker, through the router over gRPC, and
   through the router's OpenAI HTTP API (streamed /v1/completions) — policy gpu_only, so the router picks
   that same worker after probing both workers with Estimate. TTFT and time per output token are compared
   by median and p99. For scale: the round trip of a routing decision alone (Explain) and of one Estimate
   sent straight to the worker. Each router's CPU time per request over the same rotation, read from /proc,
   is the figure a busy machine disturbs least.
2. Decision time of every policy over simulated snapshots of 2, 8 and 64 workers.
3. Footprint: a router's time from process start to SERVING, and its peak and current RSS after 50 routed
   requests (``--only footprint`` runs just this).

``--compare-checkout TREE`` also measures the router of another source tree (an older commit, say) over the
same workers: its gRPC and HTTP requests join the same interleaved rotation, and its footprint runs alternate
with this one's.

Writes bench/results/router.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

from router_svc.policies import POLICIES, RouteInput
from router_svc.worker_view import QueuedWork, WorkerReport, WorkerView
from tandem.launch import free_port
from tandem.loadgen.live import wait_for_healthy_backends
from tandem.loadgen.results import percentile, write_json
from tandem.model_files import model_name, resolve_model
from tandem.stack import start_stack
from tandem.v1 import common_pb2, router_pb2, worker_pb2

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def _timed_stream(start_call) -> tuple[float, float]:
    """(TTFT, time per output token after the first) of one streamed generation: ``start_call()`` starts it and
    returns an iterable of the number of tokens in each message received."""
    start = time.perf_counter()
    token_times = []
    for num_tokens in start_call():
        token_times.extend([time.perf_counter()] * num_tokens)
    ttft = token_times[0] - start
    return ttft, (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def _grpc_tokens(responses):
    return (len(response.token_ids) for response in responses)


def _sse_tokens(client, url: str, body: dict):
    """A streamed completion over HTTP, one token per SSE chunk that carries text."""
    with client.stream("POST", url, json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                yield 1 if choices and choices[0]["text"] else 0


def _rotated(names: list[str], index: int) -> list[str]:
    """``names`` starting at ``index``: each path goes first equally often."""
    return names[index % len(names):] + names[:index % len(names)]


def _timed_call(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def measure_overhead(stack, count: int, max_new_tokens: int, checkouts: tuple[Path, ...] = (),
                     model: str | None = None) -> dict:
    """TTFT and TPOT directly to gpu_worker and through the router, interleaved; with ``checkouts``, also
    through the router of each of those source trees, over the same workers, in the same rotation."""
    from tandem.v1 import router_pb2_grpc, worker_pb2_grpc

    with contextlib.ExitStack() as routers:
        stubs = {"routed": router_pb2_grpc.RouterStub(stack.router.channel)}
        pids = {"routed": stack.router.process.pid}
        http_urls = {"http": stack.http_url}
        for index, tree in enumerate(checkouts):
            log_path = RESULTS / "router-logs" / f"router-compared-{index}.log"
            http_port = free_port()
            process, channel, _ = routers.enter_context(_router_from(tree, stack.router.args, log_path, http_port))
            stubs[str(tree)] = router_pb2_grpc.RouterStub(channel)
            pids[str(tree)] = process.process.pid
            http_urls[_http_path(tree)] = f"http://127.0.0.1:{http_port}"
        worker = worker_pb2_grpc.WorkerStub(stack.gpu.channel)
        rng = random.Random(0)
        vocab_size = worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).vocab_size
        prompt = [rng.randrange(10, min(40000, vocab_size)) for _ in range(64)]
        sampling = common_pb2.SamplingParams(temperature=0.0)
        ids = worker_pb2.TokenIds(ids=prompt)
        direct_request = worker_pb2.GenerateRequest(prompt_token_ids=ids, max_new_tokens=max_new_tokens,
                                                    sampling=sampling, ignore_eos=True)
        routed_request = router_pb2.RouteRequest(prompt_token_ids=ids, max_new_tokens=max_new_tokens,
                                                 sampling=sampling, ignore_eos=True, policy="gpu_only")
        calls = {"direct": lambda: _grpc_tokens(worker.Generate(direct_request, timeout=60))}
        calls.update({name: (lambda stub=stub: _grpc_tokens(stub.Generate(routed_request, timeout=60)))
                      for name, stub in stubs.items()})
        http_body = {"model": model_name(model), "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "tandem": {"policy": "gpu_only"}}
        http = routers.enter_context(httpx.Client())
        calls.update({name: (lambda url=url: _sse_tokens(http, f"{url}/v1/completions", http_body))
                      for name, url in http_urls.items()})
        for _ in range(3):  # warm every path and the prefix cache
            for call in calls.values():
                _timed_stream(call)
        explain = router_pb2.ExplainRequest(request=routed_request)
        estimate = worker_pb2.EstimateRequest(prompt_token_ids=prompt)
        probes = {"worker_estimate": lambda: worker.Estimate(estimate, timeout=10)}
        probes.update({name: (lambda stub=stub: stub.Explain(explain, timeout=10)) for name, stub in stubs.items()})
        round_trips = {name: [] for name in probes}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
        for index in range(count):
            for name in _rotated(list(probes), index):
                round_trips[name].append(_timed_call(probes[name]))
        cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        for index in range(count):
            for name in _rotated(list(calls), index):
                samples[name].append(_timed_stream(calls[name]))
        cpu_per_request_ms = {name: (_cpu_seconds(pid) - cpu_before[name]) / count * 1000 for name, pid in pids.items()}

    def stats(name: str, position: int) -> dict:
        values = [s[position] * 1000 for s in samples[name]]
        return {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}

    def compared_to_direct(name: str) -> dict:
        result = {}
        for metric, position in (("ttft", 0), ("tpot", 1)):
            direct_stats, routed_stats = stats("direct", position), stats(name, position)
            result[metric] = {"direct": direct_stats, "routed": routed_stats,
                              "added_p50_ms": routed_stats["p50_ms"] - direct_stats["p50_ms"],
                              "added_p99_ms": routed_stats["p99_ms"] - direct_stats["p99_ms"]}
        return result

    def round_trip(name: str) -> dict:
        return {"p50_ms": percentile(round_trips[name], 50), "p99_ms": percentile(round_trips[name], 99)}

    # Each router serves both a gRPC and an HTTP request in every round, and its CPU time covers both.
    result = {"requests_each": count, "prompt_tokens": 64, "max_new_tokens": max_new_tokens,
              **compared_to_direct("routed"), "http": compared_to_direct("http"),
              "round_trip": {"explain": round_trip("routed"), "worker_estimate": round_trip("worker_estimate")},
              "router_cpu_ms_per_round": cpu_per_request_ms["routed"]}
    if checkouts:
        result["compared"] = {str(tree): {**compared_to_direct(str(tree)), "http": compared_to_direct(_http_path(tree)),
                                          "round_trip": {"explain": round_trip(str(tree))},
                                          "router_cpu_ms_per_round": cpu_per_request_ms[str(tree)]}
                              for tree in checkouts}
    return result


def _http_path(tree: Path) -> str:
    return f"{tree} http"


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        views.append(WorkerView(WorkerReport(
            name=f"{'gpu' if gpu else 'cpu'}-{index}", kind="gpu" if gpu else "cpu", requests=queue,
            max_active_requests=4, prefill_tok_s=2551.0 if gpu else 73.0, decode_tok_s=293.0 if gpu else 45.0,
            step_base_s=0.0029 if gpu else 0.0187, step_per_prefill_token_s=0.00039 if gpu else 0.0137,
            step_per_decode_s=0.0027 if gpu else 0.0176), cached_tokens=496))
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


def measure_footprint(stack, requests: int, runs: int = 1, checkouts: tuple[Path, ...] = ()) -> dict:
    """The router's start-up time and memory: seconds from process start to health SERVING, then peak
    and current RSS after ``requests`` routed requests (half chats, half plain text, so the tokenizer works).

    A second router with the stack router's command line, on a free port and over the stack's workers,
    is started and stopped ``runs`` times. ``checkouts`` are other source trees whose
    router is measured the same way (run with PYTHONPATH set to the tree), alternating with this one's.
    """
    trees = [ROOT, *checkouts]
    samples: dict[Path, list[dict]] = {tree: [] for tree in trees}
    for run in range(runs):
        for index, tree in enumerate(trees):
            log_path = RESULTS / "router-logs" / f"router-footprint-{run}-{index}.log"
            samples[tree].append(_router_footprint(stack.router.args, tree, requests, log_path))

    def summary(measured: list[dict]) -> dict:
        medians = {key: percentile([m[key] for m in measured], 50)
                   for key in ("time_to_serving_s", "peak_rss_mib", "rss_mib")}
        return {**medians, "imports_torch": any(m["imports_torch"] for m in measured), "runs": measured}

    result = {"requests": requests, **summary(samples[ROOT])}
    if checkouts:
        result["compared"] = {str(tree): summary(samples[tree]) for tree in checkouts}
    return result


@contextlib.contextmanager
def _router_from(tree: Path, router_args: list[str], log_path: Path, http_port: int = 0):
    """A router started as ``python -m router_svc`` from source tree ``tree``, over the same workers, serving
    HTTP on ``http_port`` (any free port if 0); yields the process, a channel to it and the seconds from its
    start to health SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.launch import SERVING, ServiceProcess

    # -P: the working directory does not shadow PYTHONPATH, so the router runs from ``tree``.
    start = time.perf_counter()
    router = ServiceProcess("router-" + tree.name, None, router_args, log_path,
                            command=[sys.executable, "-P", "-m", "router_svc"],
                            env={"PYTHONPATH": str(tree), "TANDEM_HTTP_PORT": str(http_port)})
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
        yield router, channel, time.perf_counter() - start
    finally:
        channel.close()
        router.terminate()


def _router_footprint(router_args: list[str], tree: Path, requests: int, log_path: Path) -> dict:
    """Start the router of ``tree``, time it to SERVING, route ``requests``, read its memory."""
    from tandem.v1 import router_pb2_grpc

    with _router_from(tree, router_args, log_path) as (router, channel, time_to_serving_s):
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
    kib = {key: int(status[key].split()[0]) for key in ("VmHWM", "VmRSS")}
    return {"time_to_serving_s": time_to_serving_s, "peak_rss_mib": kib["VmHWM"] / 1024, "rss_mib": kib["VmRSS"] / 1024,
            "imports_torch": imports_torch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests on each path")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--decision-repeats", type=int, default=2000)
    parser.add_argument("--only", choices=["overhead", "footprint"],
                        help="run only this part, into bench/results/router-PART.json")
    parser.add_argument("--footprint-requests", type=int, default=50, help="routed requests before RSS is read")
    parser.add_argument("--footprint-runs", type=int, default=1, help="router starts measured (medians reported)")
    parser.add_argument("--model", help="the workers' model (default: the built-in one); a tiny model's short steps "
                                            "leave the router's own overhead standing out")
    parser.add_argument("--compare-checkout", type=Path, action="append", default=[], metavar="TREE",
                        help="also measure the router of this source tree over the same workers (repeatable)")
    args = parser.parse_args()
    checkouts = tuple(path.resolve() for path in args.compare_checkout)
    report = {}
    if args.only is None:
        report["decision_time"] = measure_decisions(args.decision_repeats)
    stack = start_stack(str(resolve_model(args.model)), RESULTS / "router-logs")
    try:
        stack.wait_for_health()
        asyncio.run(wait_for_healthy_backends(stack.router.address))
        if args.only in (None, "overhead"):
            report["overhead"] = measure_overhead(stack, args.requests, args.max_new_tokens, checkouts, args.model)
        if args.only in (None, "footprint"):
            report["router_footprint"] = measure_footprint(stack, args.footprint_requests, args.footprint_runs,
                                                           checkouts)
    finally:
        stack.stop()
    output = RESULTS / (f"router-{args.only}.json" if args.only else "router.json")
    write_json(output, report)
    if "overhead" in report:
        overhead = report["overhead"]
        for tree, measured in [(str(ROOT), overhead), *overhead.get("compared", {}).items()]:
            print(f"router ({tree}): TTFT direct p50 {measured['ttft']['direct']['p50_ms']:.2f} ms, routed p50 "
                  f"{measured['ttft']['routed']['p50_ms']:.2f} ms: added p50 {measured['ttft']['added_p50_ms']:.2f} ms, "
                  f"p99 {measured['ttft']['added_p99_ms']:.2f} ms; TPOT added p50 "
                  f"{measured['tpot']['added_p50_ms']:.3f} ms; Explain (probes + decision) p50 "
                  f"{measured['round_trip']['explain']['p50_ms']:.2f} ms; CPU {measured['router_cpu_ms_per_round']:.2f} ms "
                  "per round")
        for tree, measured in [(str(ROOT), overhead), *overhead.get("compared", {}).items()]:
            http = measured["http"]
            print(f"OpenAI HTTP API ({tree}): TTFT p50 {http['ttft']['routed']['p50_ms']:.2f} ms: added p50 "
                  f"{http['ttft']['added_p50_ms']:.2f} ms, p99 {http['ttft']['added_p99_ms']:.2f} ms; TPOT added p50 "
                  f"{http['tpot']['added_p50_ms']:.3f} ms")
        print(f"one Estimate straight to the worker p50 {overhead['round_trip']['worker_estimate']['p50_ms']:.2f} ms")
    if "decision_time" in report:
        sizes = ("2 workers", "8 workers", "64 workers")
        print(f"{'policy':<14}" + "".join(f"{n:>12}" for n in sizes) + "   (p50 µs)")
        for name, by_size in report["decision_time"].items():
            print(f"{name:<14}" + "".join(f"{by_size[n]['p50_us']:>12.1f}" for n in ("2", "8", "64")))
    if "router_footprint" in report:
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
