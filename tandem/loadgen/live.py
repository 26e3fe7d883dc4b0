"""`tandem bench`: drive the router, one worker, or any OpenAI-compatible server with a workload; write JSON and plots.

Requests are sent at their workload arrival times without waiting for replies. A request whose real
output length is below its budget is ended by the client after that many tokens, as a client that has
what it needs would: the worker frees its slot at once, and the router's view shows the freed budget.

Targets (one at a time; every target gets the same schedule and the same records):

  --router HOST:PORT  Tandem's router over gRPC (the default target); every routing decision is recorded too.
  --worker HOST:PORT  one Tandem worker over gRPC, no router.
  --openai URL        any OpenAI-compatible server (Tandem's HTTP front end, vLLM, llama.cpp's server, ...)
                      at its API base, e.g. http://127.0.0.1:8000/v1.

With --openai each request is a streamed POST URL/completions whose prompt is the workload's token id
list, with temperature 0, ignore_eos true and stream_options.include_usage. A request's worker is the
x-tandem-worker response header where the server sends one, else "server"; its cached prompt tokens are
usage.prompt_tokens_details.cached_tokens where reported; no routing decisions are recorded. A generic
server cannot say its vocabulary size, so token ids are drawn below --vocab-size (default 32000, which
the vocabulary of every common model covers). Each shared prefix is warmed by one request through the
server, so a server fronting several workers holds it on the worker it placed it on only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from google.protobuf import json_format

from tandem.loadgen import plots
from tandem.loadgen.results import OK, RequestRecord, records_json, summarize, write_json
from tandem.loadgen.workloads import Workload, WorkloadRequest, add_workload_arguments, build_workload
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

RESULTS_DIR = Path("bench/results")
OPENAI_VOCAB_SIZE = 32000  # --openai's default --vocab-size: Llama 2 and Mistral have 32000 ids, most models more
SERVER = "server"  # the worker of a request whose OpenAI-compatible server does not name one
WORKER_HEADER = "x-tandem-worker"


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


@dataclass(frozen=True)
class Reply:
    """What a target reports of one request; the shared loop adds the arrival and finish times."""

    worker: str
    first_token_s: float | None
    tokens: int
    status: str = OK
    cached_tokens: int = 0


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


Clock = Callable[[], float]
Perform = Callable[[WorkloadRequest, Clock], Awaitable[Reply]]  # makes one request, says how it went


async def drive(workload: Workload, perform: Perform, label: str) -> list[RequestRecord]:
    """Start each request of ``workload`` at its arrival time with ``perform(request, clock)``, which makes the
    request and returns its Reply (``clock()`` is the time since the run's start), and record every request."""
    progress = Progress(len(workload.requests), label)
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def one(request: WorkloadRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, request.arrival_s - clock()))
        arrival = clock()
        reply = await perform(request, clock)
        record = RequestRecord(request.req_id, reply.worker, arrival, reply.first_token_s, clock(),
                               min(reply.tokens, request.output_tokens), reply.status, reply.cached_tokens)
        progress.update(reply.status == OK)
        return record

    return list(await asyncio.gather(*(one(request) for request in workload.requests)))


async def run_workload(address: str, workload: Workload, workers: list[WorkerEndpoint], *, via_router: bool,
                       policy: str = "", label: str = "", timeout_s: float = 600.0) -> BenchRun:
    """Send every request of ``workload`` at its arrival time to the router (or, without ``via_router``,
    to the one worker in ``workers``) at ``address``."""
    worker_name = workers[0].name
    decisions: list[dict] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel) if via_router else worker_pb2_grpc.WorkerStub(channel)

        async def perform(request: WorkloadRequest, clock: Clock) -> Reply:
            call = stub.Generate(_message(request, via_router, policy), timeout=timeout_s)
            first_token, tokens, worker, status, cached = None, 0, worker_name, OK, 0
            try:
                async for response in call:
                    if via_router and response.HasField("decision"):
                        decisions.append({"request_id": request.req_id,
                                          **json_format.MessageToDict(response.decision,
                                                                      preserving_proto_field_name=True)})
                        continue
                    if response.token_ids:
                        first_token = first_token if first_token is not None else clock()
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
            return Reply(worker, first_token, tokens, status, cached)

        records = await drive(workload, perform, label or workload.name)
    return BenchRun(label or policy or workload.name, workers, records, decisions)


def _message(request: WorkloadRequest, via_router: bool, policy: str):
    fields = dict(request_id=request.req_id, prompt_token_ids=worker_pb2.TokenIds(ids=request.prompt_token_ids),
                  max_new_tokens=request.max_new_tokens, sampling=common_pb2.SamplingParams(temperature=0.0),
                  ignore_eos=True)
    if via_router:
        return router_pb2.RouteRequest(policy=policy, **fields)
    return worker_pb2.GenerateRequest(**fields)


# --- OpenAI-compatible servers ----------------------------------------------------------------------------


class OpenAIServer:
    """An OpenAI-compatible server at ``base_url`` (the API base, ending in ``/v1`` for most servers)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection limit: a pool that queued requests would delay them past their arrival times.
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                        transport=transport)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> "OpenAIServer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def first_model(self) -> str:
        """The first model id ``GET /models`` lists."""
        response = await self.client.get("/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise ValueError(f"{self.client.base_url}/models lists no model; name one with --model")
        return models[0]["id"]

    @staticmethod
    def body(model: str, prompt: tuple[int, ...], max_tokens: int, policy: str = "", stream: bool = True) -> dict:
        body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if policy:  # Tandem's extension; other servers refuse unknown fields, so only when asked for
            body["tandem"] = {"policy": policy}
        return body

    async def warm(self, model: str, prefixes: tuple[tuple[int, ...], ...]) -> None:
        """Compute each prefix once through the server (one request each, one output token)."""
        for prefix in prefixes:
            response = await self.client.post("/completions", json=self.body(model, prefix, 1, stream=False))
            response.raise_for_status()

    async def complete(self, request: WorkloadRequest, clock: Clock, model: str,
                       policy: str = "") -> Reply:
        """One streamed completion of ``request``, ended early at its real output length."""
        worker, first_token, chunks, usage, status = SERVER, None, 0, None, OK
        try:
            async with asyncio.timeout(self.timeout_s), self.client.stream(
                    "POST", "/completions", json=self.body(model, request.prompt_token_ids, request.max_new_tokens,
                                                           policy)) as response:
                worker = response.headers.get(WORKER_HEADER) or SERVER
                if response.status_code != 200:
                    await response.aread()
                    return Reply(worker, None, 0, f"HTTP_{response.status_code}")
                finished = False
                async for event in _sse_data(response):
                    if event == "[DONE]":
                        finished = True
                        break
                    chunk = json.loads(event)
                    if "error" in chunk:
                        error = chunk["error"]
                        status = (error.get("type") if isinstance(error, dict) else None) or "STREAM_ERROR"
                        break
                    if any(choice.get("text") for choice in chunk.get("choices") or ()):
                        first_token = first_token if first_token is not None else clock()
                        chunks += 1
                    usage = chunk.get("usage") or usage
                    if request.output_tokens <= chunks < request.max_new_tokens:
                        finished = True
                        break  # its natural end came before the budget: closing the stream ends it
                if not finished and status == OK:
                    status = "INCOMPLETE_STREAM"  # the server closed the stream without [DONE]
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            status = type(exc).__name__
        tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") is not None else chunks
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply(worker, first_token, tokens, status, cached)


async def _sse_data(response: httpx.Response):
    """The ``data`` fields of a server-sent event stream, one per line, as the OpenAI SDK reads them."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].removeprefix(" ")


async def run_openai_workload(server: OpenAIServer, workload: Workload, model: str, *, policy: str = "",
                              label: str = "") -> BenchRun:
    """Send every request of ``workload`` at its arrival time to the OpenAI-compatible ``server``. The run's
    workers are those the replies named (``server`` where none did)."""

    async def perform(request: WorkloadRequest, clock: Clock) -> Reply:
        return await server.complete(request, clock, model, policy)

    records = await drive(workload, perform, label or workload.name)
    address = str(server.client.base_url)
    workers = [WorkerEndpoint(name, "", address) for name in sorted({r.worker for r in records})]
    return BenchRun(label or policy or workload.name, workers, records)


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
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__.split("\n\n", 1)[0].split(": ", 1)[1],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--router", default="127.0.0.1:50051", help="router address (default target)")
    target.add_argument("--worker", default=None, metavar="HOST:PORT", help="drive one worker directly instead")
    target.add_argument("--openai", default=None, metavar="URL",
                        help="drive an OpenAI-compatible server instead, at its API base, "
                             "e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--policy", nargs="+", default=[""],
                        help="routing policies to run one after another, each with freshly drawn token ids of the "
                             "same shapes (default: the router's own policy; with --openai, each is sent as "
                             '{"tandem": {"policy": ...}}, which only Tandem accepts)')
    openai = parser.add_argument_group("OpenAI-compatible server (--openai)")
    openai.add_argument("--model", default=None, help="model to request (default: the first id of GET URL/models)")
    openai.add_argument("--api-key", default=None, metavar="KEY",
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY; none when unset)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="workload token ids are drawn from [10, N) (default: the worker's vocabulary; "
                             f"with --openai, {OPENAI_VOCAB_SIZE})")
    add_workload_arguments(parser)
    parser.add_argument("--no-warm", action="store_true", help="do not warm the workload's shared prefixes first")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default bench/results/bench-<workload>-<requests>.json)")
    return parser


async def _bench(args: argparse.Namespace) -> int:
    if args.openai is not None:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        async with OpenAIServer(args.openai, api_key, args.timeout_s) as server:
            model = args.model or await server.first_model()

            async def run(workload: Workload, policy: str, label: str) -> BenchRun:
                if workload.warm_prefixes and not args.no_warm:
                    await server.warm(model, workload.warm_prefixes)
                return await run_openai_workload(server, workload, model, policy=policy, label=label)

            return await _runs(args, args.vocab_size or OPENAI_VOCAB_SIZE, args.policy, run)
    via_router = args.worker is None
    address = args.router if via_router else args.worker
    workers = await router_workers(address) if via_router else [WorkerEndpoint("worker", "", address)]
    if not workers:
        print("error: the router has no workers", file=sys.stderr)
        return 1

    async def run(workload: Workload, policy: str, label: str) -> BenchRun:
        if workload.warm_prefixes and not args.no_warm:
            await warm(workers, workload.warm_prefixes)
        return await run_workload(address, workload, workers, via_router=via_router, policy=policy, label=label,
                                  timeout_s=args.timeout_s)

    vocab_size = args.vocab_size or await worker_vocab_size(workers[0].address)
    return await _runs(args, vocab_size, args.policy if via_router else [""], run)


async def _runs(args: argparse.Namespace, vocab_size: int, policies: list[str],
                run: Callable[[Workload, str, str], Awaitable[BenchRun]]) -> int:
    """One run per policy with ``run(workload, policy, label)``, each written and summarized on one line."""
    output = args.output or RESULTS_DIR / f"bench-{args.workload}-{args.requests}.json"
    runs = {}
    seed = args.seed
    for index, policy in enumerate(policies):
        # Each run draws its own token ids (same shapes), so no run finds another run's prompts cached.
        args.seed = seed + index
        workload = build_workload(args, vocab_size)
        result = await run(workload, policy, policy or "default")
        path = output if len(policies) == 1 else output.with_name(f"{output.stem}-{result.label}{output.suffix}")
        summary = write_run(result, workload, path)
        runs[result.label] = result.records
        print(f"{result.label}: makespan {summary['makespan_s']:.2f} s, {summary['output_tok_s']:.1f} tok/s, "
              f"TTFT p50 {_ms(summary['ttft_p50_s'])} p95 {_ms(summary['ttft_p95_s'])}, "
              f"per worker {summary['requests_per_worker']}, outcomes {summary['outcomes']} -> {path}")
    plots.latency_cdfs(runs, output.with_name(output.stem + "-cdf.png"), f"{args.workload}, {args.requests} requests")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.openai is None and (args.model or args.api_key):
        parser.error("--model and --api-key apply to --openai only")
    if args.vocab_size is not None and args.vocab_size <= 10:
        parser.error("--vocab-size must be above 10 (token ids are drawn from [10, N))")
    try:
        return asyncio.run(_bench(args))
    except ValueError as exc:
        parser.error(str(exc))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except httpx.HTTPStatusError as exc:
        print(f"error: {exc.request.method} {exc.request.url}: HTTP {exc.response.status_code}: "
              f"{exc.response.text[:500]}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
