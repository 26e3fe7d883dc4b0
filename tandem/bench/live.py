"""`tandem bench`: drive the router, or one worker directly, with a workload; write JSON and plots.

Requests are sent at their workload arrival times without waiting for replies. A request whose real
output length is below its budget is ended by the client after that many tokens, as a client that has
what it needs would: the worker frees its slot at once, and the router's view shows the freed budget.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format

from tandem.bench import plots
from tandem.bench.results import OK, RequestRecord, records_json, summarize, write_json
from tandem.bench.workloads import Workload, WorkloadRequest, add_workload_arguments, build_workload
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

RESULTS_DIR = Path("bench/results")


@dataclass(frozen=True)
class WorkerEndpoint:
    name: str
    kind: str
    address: str


@dataclass
class BenchRun:
    """One run of a workload: every request's record and, through a router, every routing decision."""

    label: str
    workers: list[WorkerEndpoint]
    records: list[RequestRecord]
    decisions: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        summary = summarize(self.records, [w.name for w in self.workers])
        kinds = {w.name: w.kind for w in self.workers}
        summary["offloaded_to_cpu"] = sum(n for name, n in summary["requests_per_worker"].items()
                                          if kinds.get(name) == "cpu")
        return summary


async def router_workers(address: str) -> list[WorkerEndpoint]:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await router_pb2_grpc.RouterStub(channel).ListBackends(router_pb2.ListBackendsRequest(), timeout=10)
    return [WorkerEndpoint(b.name, common_pb2.WorkerKind.Name(b.kind).removeprefix("WORKER_KIND_").lower(), b.address)
            for b in response.backends]


async def wait_for_healthy_backends(address: str, timeout_s: float = 120.0) -> None:
    """Return once the router at ``address`` reports every configured worker healthy."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            backends = (await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)).backends
            if backends and all(b.healthy for b in backends):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"the router at {address} did not see every worker healthy within {timeout_s:.0f} s")


async def worker_vocab_size(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return info.vocab_size


async def warm(workers: list[WorkerEndpoint], prefixes: tuple[tuple[int, ...], ...]) -> None:
    """Compute each prefix once on every worker, so it sits in every prefix cache."""
    for worker in workers:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for prefix in prefixes:
                request = worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prefix), max_new_tokens=1,
                                                     sampling=common_pb2.SamplingParams(temperature=0.0))
                async for _ in stub.Generate(request, timeout=600):
                    pass


class Progress:
    """A one-line progress bar on a terminal; silent elsewhere."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.enabled = sys.stderr.isatty()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.enabled:
            filled = round(30 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
                             f"{f', {self.failed} failed' if self.failed else ''}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_workload(address: str, workload: Workload, workers: list[WorkerEndpoint], *, via_router: bool,
                       policy: str = "", label: str = "", timeout_s: float = 600.0) -> BenchRun:
    """Send every request of ``workload`` at its arrival time to the router (or, without ``via_router``,
    to the one worker in ``workers``) at ``address``."""
    worker_name = workers[0].name
    progress = Progress(len(workload.requests), label or workload.name)
    decisions: list[dict] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel) if via_router else worker_pb2_grpc.WorkerStub(channel)
        start = time.perf_counter()

        async def one(request: WorkloadRequest) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
            arrival = time.perf_counter() - start
            message = _message(request, via_router, policy)
            call = stub.Generate(message, timeout=timeout_s)
            first_token, tokens, worker, status, cached = None, 0, worker_name, OK, 0
            try:
                async for response in call:
                    if via_router and response.HasField("decision"):
                        decisions.append({"request_id": request.req_id,
                                          **json_format.MessageToDict(response.decision,
                                                                      preserving_proto_field_name=True)})
                        continue
                    if response.token_ids:
                        first_token = first_token if first_token is not None else time.perf_counter() - start
                        tokens += len(response.token_ids)
                    worker = getattr(response, "worker", "") or worker
                    if response.HasField("result"):
                        cached = response.result.usage.cached_tokens
                    if request.output_tokens <= tokens < request.max_new_tokens:
                        break  # its natural end came before the budget
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            finally:
                call.cancel()
            record = RequestRecord(request.req_id, worker, arrival, first_token, time.perf_counter() - start,
                                   min(tokens, request.output_tokens), status, cached)
            progress.update(status == OK)
            return record

        records = await asyncio.gather(*(one(request) for request in workload.requests))
    return BenchRun(label or policy or workload.name, workers, list(records), decisions)


def _message(request: WorkloadRequest, via_router: bool, policy: str):
    fields = dict(request_id=request.req_id, prompt_token_ids=worker_pb2.TokenIds(ids=request.prompt_token_ids),
                  max_new_tokens=request.max_new_tokens, sampling=common_pb2.SamplingParams(temperature=0.0),
                  ignore_eos=True)
    if via_router:
        return router_pb2.RouteRequest(policy=policy, **fields)
    return worker_pb2.GenerateRequest(**fields)


def write_run(run: BenchRun, workload: Workload, path: Path, plot: bool = True) -> dict:
    """JSON at ``path`` (summary, every request, every decision) and, with ``plot``, a timeline PNG beside it."""
    payload = {"label": run.label, "workload": workload.describe(),
               "workers": [vars(w) for w in run.workers], **run.summary(),
               "requests": records_json(run.records), "decisions": run.decisions}
    write_json(path, payload)
    if plot:
        plots.timeline(run.records, path.with_name(path.stem + "-timeline.png"),
                       f"{workload.name}, {len(workload.requests)} requests, {run.label}")
    return payload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__.splitlines()[0].split(": ", 1)[1])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--router", default="127.0.0.1:50051", help="router address (default target)")
    target.add_argument("--worker", default=None, metavar="HOST:PORT", help="drive one worker directly instead")
    parser.add_argument("--policy", nargs="+", default=[""],
                        help="routing policies to run one after another, each with freshly drawn token ids of the "
                             "same shapes (default: the router's own policy)")
    add_workload_arguments(parser)
    parser.add_argument("--no-warm", action="store_true", help="do not warm the workload's shared prefixes first")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default bench/results/bench-<workload>-<requests>.json)")
    return parser


async def _bench(args: argparse.Namespace) -> int:
    via_router = args.worker is None
    address = args.router if via_router else args.worker
    workers = await router_workers(address) if via_router else [WorkerEndpoint("worker", "", address)]
    if not workers:
        print("error: the router has no workers", file=sys.stderr)
        return 1
    vocab_size = await worker_vocab_size(workers[0].address)
    output = args.output or RESULTS_DIR / f"bench-{args.workload}-{args.requests}.json"
    runs = {}
    seed = args.seed
    for index, policy in enumerate(args.policy if via_router else [""]):
        # Each run draws its own token ids (same shapes), so no run finds another run's prompts cached.
        args.seed = seed + index
        workload = build_workload(args, vocab_size)
        if workload.warm_prefixes and not args.no_warm:
            await warm(workers, workload.warm_prefixes)
        run = await run_workload(address, workload, workers, via_router=via_router, policy=policy,
                                 label=policy or "default", timeout_s=args.timeout_s)
        path = output if len(args.policy) == 1 else output.with_name(f"{output.stem}-{run.label}{output.suffix}")
        summary = write_run(run, workload, path)
        runs[run.label] = run.records
        print(f"{run.label}: makespan {summary['makespan_s']:.2f} s, {summary['output_tok_s']:.1f} tok/s, "
              f"TTFT p50 {_ms(summary['ttft_p50_s'])} p95 {_ms(summary['ttft_p95_s'])}, "
              f"per worker {summary['requests_per_worker']}, outcomes {summary['outcomes']} -> {path}")
    plots.latency_cdfs(runs, output.with_name(output.stem + "-cdf.png"), f"{args.workload}, {args.requests} requests")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_bench(args))
    except ValueError as exc:
        parser.error(str(exc))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
