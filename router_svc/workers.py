"""The workers as the router sees them: connection, health, latest state, in-flight credit, and membership."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind

from router_svc import metrics
from router_svc.errors import Status, WorkerCallFailed
from router_svc.prefix_index import PrefixIndex, PromptBlocks
from router_svc.probes import ProbeStream
from router_svc.worker_view import Credit, WorkerReport, WorkerView, reported_block_size
from tandem.protocol import WORKER_KINDS
from tandem.security import ClientTLS, aio_channel
from tandem.serving import keepalive_options
from tandem.telemetry import child_span, mark_failed, outgoing_metadata, tracer
from tandem.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
_tracer = tracer("tandem.router")

WATCH_INTERVAL_S = 0.5
KEEPALIVE_S = 10.0
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)=(?P<kind>cpu|gpu)@(?P<host>[^:@]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class WorkerAddress:
    name: str
    kind: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, spec: str) -> "WorkerAddress":
        """Parse ``NAME=KIND@HOST:PORT`` (KIND is cpu or gpu)."""
        match = _SPEC.match(spec.strip())
        if match is None or not 0 < int(match["port"]) < 65536:
            raise ValueError(f"worker {spec!r}: expected NAME=KIND@HOST:PORT with KIND cpu or gpu")
        return cls(match["name"], match["kind"], match["host"], int(match["port"]))


STATIC = "static"


class Worker:
    """One worker: a channel, a WatchState subscription with reconnection (its snapshots and its prefix
    cache's hash index), and the router's accounting.

    ``source`` says how it joined: ``static`` (``--worker``) or the discovery that found it. A worker that
    left (``leaving``) gets no new requests and stays until its in-flight streams end.
    """

    def __init__(self, address: WorkerAddress, registry: "WorkerRegistry", source: str = STATIC):
        self.address = address
        self.name = address.name
        self.kind = address.kind
        self.source = source
        self.leaving = False
        self._registry = registry
        self.channel = aio_channel(address.address, registry.tls, keepalive_options(registry.keepalive_s))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.info: worker_pb2.GetInfoResponse | None = None
        self.state: common_pb2.BackendState | None = None
        self.prefix_index = PrefixIndex()
        self.connected = False
        self.status = "connecting"
        self.credits: dict[str, Credit] = {}
        self._probes: ProbeStream | None = None
        self.routed_requests = 0
        self.failed_requests = 0

    @property
    def healthy(self) -> bool:
        return (
            not self.leaving
            and self.connected
            and self.info is not None
            and self._registry.fingerprint_matches(self)
            and self.state is not None
            and self.state.serving_state == common_pb2.SERVING_STATE_SERVING
        )

    def describe(self) -> str:
        if self.leaving:
            return f"leaving ({len(self.credits)} in flight)"
        if self.healthy:
            return "serving"
        if self.connected and self.info is not None and not self._registry.fingerprint_matches(self):
            return "refused: serves a different model (fingerprint mismatch)"
        if self.connected and self.state is not None:
            return common_pb2.ServingState.Name(self.state.serving_state).removeprefix("SERVING_STATE_").lower()
        return self.status

    def message(self) -> router_pb2.Backend:
        """This worker as ListBackends reports it."""
        info = self.info
        return router_pb2.Backend(
            name=self.name, address=self.address.address, kind=WORKER_KINDS[self.kind],
            device=self.state.device if self.state is not None else (info.device if info else ""),
            healthy=self.healthy, status=self.describe(), state=self.state,
            model_fingerprint=info.model_fingerprint if info else "", routed_requests=self.routed_requests,
            inflight_requests=len(self.credits), failed_requests=self.failed_requests, source=self.source,
        )

    def dispatch(self, request_id: str, prompt: PromptBlocks, prefill_tokens: int, decode_tokens: int,
                 constrained: bool = False) -> None:
        """Credit the request to this worker and expect its prompt's blocks in the worker's cache."""
        self.credits[request_id] = Credit(request_id, prefill_tokens, decode_tokens, constrained)
        self.routed_requests += 1
        if self.state is not None:
            self.prefix_index.expect(prompt, reported_block_size(self.state))

    def release(self, request_id: str) -> None:
        self.credits.pop(request_id, None)
        if self.leaving and not self.credits:
            self._registry.drained(self)

    def indexed_view(self, prompt: PromptBlocks) -> WorkerView:
        """This worker's view for a policy: its latest snapshot, the prompt looked up in its prefix index
        (which must be synced), plus credit."""
        report = self.report(self.state)
        cached, evictable = self.prefix_index.cached(prompt, report.block_size)
        return WorkerView.of(report, cached, self.credits.values(), "index", evictable)

    def view(self, estimate: common_pb2.BackendState | None) -> WorkerView:
        """This worker's view for a policy: the fresh estimate (or the latest snapshot) plus credit."""
        report = self.report(estimate if estimate is not None else self.state)
        if estimate is None:
            return WorkerView.of(report, 0, self.credits.values(), "snapshot")
        return WorkerView.of(report, estimate.cached_tokens, self.credits.values(), "estimate",
                          estimate.cached_tokens_evictable)

    def report(self, state: common_pb2.BackendState) -> WorkerReport:
        return WorkerReport.from_state(self.name, self.kind, state, self.info)

    def generate(self, request: worker_pb2.GenerateRequest, timeout: float | None, parent_span) -> "WorkerCall":
        """Start a Generate call on this worker now; iterate the result for its responses."""
        return WorkerCall(self, request, timeout, parent_span)

    def probe(self, request: worker_pb2.EstimateRequest) -> asyncio.Future:
        """Ask for a fresh Estimate; the future holds the answer, or None if the worker cannot answer."""
        if self._probes is None or self._probes.closed:
            self._probes = ProbeStream(self.stub)
        return self._probes.ask(request)

    def close_probes(self) -> None:
        if self._probes is not None:
            self._probes.close()
            self._probes = None

    def update(self, state: common_pb2.BackendState) -> None:
        if self.state is None or state.seq >= self.state.seq:
            self.state = state

    async def watch(self) -> None:
        """Keep ``info`` and ``state`` current; reconnect with exponential backoff, forever."""
        backoff = BACKOFF_INITIAL_S
        while True:
            try:
                health = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if health.status != health_pb2.HealthCheckResponse.SERVING:
                    self.status = "not serving yet"
                    raise _Retry
                self.info = await self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
                self._registry.register_fingerprint(self)
                self.state = None  # a restarted worker counts its sequence numbers from the start again
                watch = worker_pb2.WatchStateRequest(interval_s=WATCH_INTERVAL_S, prefix_cache_changes=True)
                async for state in self.stub.WatchState(watch):
                    if not self.connected:
                        logger.info("worker %s at %s connected (%s)", self.name, self.address.address, state.device)
                    self.prefix_index.apply(state.prefix_cache_changes)
                    state.ClearField("prefix_cache_changes")
                    self.update(state)
                    self.connected = True
                    backoff = BACKOFF_INITIAL_S
            except asyncio.CancelledError:
                raise
            except _Retry:
                pass
            except grpc.aio.AioRpcError as exc:
                self.status = f"unreachable: {exc.code().name}"
            if self.connected:
                logger.warning("worker %s at %s lost (%s)", self.name, self.address.address, self.status)
            self.connected = False
            self.prefix_index.forget()
            self.close_probes()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)


class _Retry(Exception):
    pass


class WorkerCall:
    """One Generate call to a worker, started at once, traced as a CLIENT span.

    Iterating yields the worker's responses; a failed call raises ``WorkerCallFailed``. ``close``
    cancels the call (leaving the loop does not cancel a grpc.aio call) and ends the span.
    """

    def __init__(self, worker: Worker, request: worker_pb2.GenerateRequest, timeout: float | None, parent_span):
        self.worker = worker.name
        self.span = child_span(_tracer, parent_span, "tandem.v1.Worker/Generate", SpanKind.CLIENT, {
            "rpc.system": "grpc", "rpc.service": "tandem.v1.Worker", "rpc.method": "Generate",
            "server.address": worker.address.host, "server.port": worker.address.port, "tandem.worker": worker.name,
        })
        self._call = worker.stub.Generate(request, timeout=timeout, metadata=outgoing_metadata(self.span))
        self._responses = self._call.__aiter__()

    def __aiter__(self) -> "WorkerCall":
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        try:
            return await self._responses.__anext__()
        except StopAsyncIteration:
            raise
        except grpc.aio.AioRpcError as exc:
            mark_failed(self.span, exc)
            raise WorkerCallFailed(self.worker, Status[exc.code().name], exc.details()) from None
        except BaseException as exc:
            mark_failed(self.span, exc)
            raise

    def close(self) -> None:
        self._call.cancel()
        self.span.end()


async def probe_all(workers: list[Worker], prompt_token_ids: list[int],
                    deadline_s: float) -> list[common_pb2.BackendState | None]:
    """Estimate from every worker at once; None for each that did not answer within ``deadline_s``."""
    request = worker_pb2.EstimateRequest(prompt_token_ids=prompt_token_ids)
    answers = [worker.probe(request) for worker in workers]
    try:
        if answers:
            await asyncio.wait(answers, timeout=deadline_s)
    finally:
        for answer in answers:
            answer.cancel()  # does nothing to an answered probe; a late answer is read and dropped
    estimates = [None if answer.cancelled() else answer.result() for answer in answers]
    for worker, state in zip(workers, estimates):
        if state is not None:
            worker.update(state)
    return estimates


class WorkerRegistry:
    """The workers: those configured with ``--worker`` and those discovery finds while the router runs.

    Only workers whose model fingerprint equals the reference are routed to. A worker that leaves is taken
    out of routing at once; its channel closes when its last in-flight stream ends.

    Args:
        reference_fingerprint: the fingerprint of the model the router was configured with; when None,
            the first fingerprint a worker reports becomes the reference.
        tls: TLS (and mTLS) settings for the channels to the workers; None for plaintext.
        keepalive_s: the channels' keepalive (``tandem.serving.keepalive_options``).
    """

    def __init__(self, addresses: list[WorkerAddress], reference_fingerprint: str | None = None,
                 tls: ClientTLS | None = None, keepalive_s: float = KEEPALIVE_S):
        self.tls = tls
        self.keepalive_s = keepalive_s
        names = [a.name for a in addresses]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique: {names}")
        self.workers = {address.name: Worker(address, self) for address in addresses}
        self.draining: set[Worker] = set()
        self.reference_fingerprint = reference_fingerprint
        self._watches: dict[Worker, asyncio.Task] = {}
        self._discoveries: list[asyncio.Task] = []
        self._started = False

    def start(self, discoveries=()) -> None:
        """Watch every configured worker, and run each discovery (an object with ``async run(registry)``)."""
        self._started = True
        for worker in self.workers.values():
            self._watch(worker)
        self._count_members()
        self._discoveries = [asyncio.create_task(d.run(self), name=f"discover-{d.source}") for d in discoveries]

    async def stop(self) -> None:
        tasks = [*self._discoveries, *self._watches.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        workers = [*self.workers.values(), *self.draining]
        for worker in workers:
            worker.close_probes()
        await asyncio.gather(*(b.channel.close() for b in workers))

    def reconcile(self, source: str, addresses: list[WorkerAddress]) -> None:
        """Make the workers found by ``source`` exactly ``addresses``: new ones join, missing ones leave."""
        wanted = {address.name: address for address in addresses}
        for worker in [b for b in self.workers.values() if b.source == source]:
            if worker.address != wanted.get(worker.name):
                self.leave(worker)
        for name, address in wanted.items():
            present = self.workers.get(name)
            if present is None:
                self.join(address, source)
            elif present.source != source:
                logger.warning("%s found worker %s at %s, but %s already has that name; skipped", source, name,
                               address.address, present.source)

    def join(self, address: WorkerAddress, source: str) -> Worker:
        worker = Worker(address, self, source)
        self.workers[address.name] = worker
        logger.info("worker %s (%s) at %s joined (%s)", address.name, address.kind, address.address, source)
        metrics.MEMBERSHIP_CHANGES.labels(source, "join").inc()
        if self._started:
            self._watch(worker)
        self._count_members()
        return worker

    def leave(self, worker: Worker) -> None:
        """No new requests for ``worker``; it is closed once its in-flight streams have ended."""
        del self.workers[worker.name]
        worker.leaving = True
        self.draining.add(worker)
        logger.info("worker %s at %s left (%s); %d streams in flight finish on it", worker.name,
                    worker.address.address, worker.source, len(worker.credits))
        metrics.MEMBERSHIP_CHANGES.labels(worker.source, "leave").inc()
        self._count_members()
        if not worker.credits:
            self.drained(worker)

    def drained(self, worker: Worker) -> None:
        self.draining.discard(worker)
        watch = self._watches.pop(worker, None)
        if watch is not None:
            watch.cancel()
        worker.close_probes()
        asyncio.get_running_loop().create_task(worker.channel.close())

    def listed(self) -> list[Worker]:
        """Every worker, leaving ones included, as ListBackends shows them."""
        return [*self.workers.values(), *self.draining]

    def register_fingerprint(self, worker: Worker) -> None:
        fingerprint = worker.info.model_fingerprint
        if self.reference_fingerprint is None:
            self.reference_fingerprint = fingerprint
        elif fingerprint != self.reference_fingerprint:
            logger.error("worker %s serves a different model (fingerprint %s, expected %s); not routing to it",
                         worker.name, fingerprint[:12], self.reference_fingerprint[:12])
            metrics.WORKERS_REFUSED.labels(worker.source, "fingerprint").inc()

    def fingerprint_matches(self, worker: Worker) -> bool:
        return worker.info is not None and worker.info.model_fingerprint == self.reference_fingerprint

    def healthy(self) -> list[Worker]:
        return [b for b in self.workers.values() if b.healthy]

    def model_limits(self) -> tuple[int, int] | None:
        """(tokens a request may span, vocabulary size) of the served model, as its workers report them: the
        context length, or less where no worker's KV cache holds that many; None before any worker reported."""
        infos = [b.info for b in self.workers.values() if b.info is not None and self.fingerprint_matches(b)]
        if not infos:
            return None
        largest_cache = max(info.kv_blocks_total * info.block_size for info in infos)
        return min(min(info.context_length for info in infos), largest_cache), min(info.vocab_size for info in infos)

    def _watch(self, worker: Worker) -> None:
        self._watches[worker] = asyncio.create_task(worker.watch(), name=f"watch-{worker.name}")

    def _count_members(self) -> None:
        for kind in WORKER_KINDS:
            metrics.WORKERS.labels(kind).set(sum(b.kind == kind for b in self.workers.values()))
