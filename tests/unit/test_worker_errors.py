"""The worker servicer: each engine error maps to one status code in every RPC, and a call's writes never overlap."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from tandem.errors import EngineDeadError, InvalidRequestError, QueueFullError
from tandem.engine.request import FinishReason
from tandem.v1 import worker_pb2
from tandem.worker.servicer import WorkerServicer


class Aborted(Exception):
    pass


class FakeContext:
    """The parts of grpc.aio.ServicerContext the servicer uses; ``abort`` records the status and raises."""

    def __init__(self):
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata):
        pass

    async def abort(self, code: grpc.StatusCode, details: str):
        self.status = (code, details)
        raise Aborted

    def code(self):
        return self.status[0] if self.status else None

    def details(self):
        return self.status[1] if self.status else None


class FakeEngine:
    """Generates nothing but ``outcome``: an exception it raises, or one output it yields."""

    def __init__(self, outcome):
        self.outcome = outcome

    async def generate(self, request, on_queued=None):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        yield self.outcome


async def generate_status(engine, request=None) -> tuple[grpc.StatusCode, str]:
    servicer = WorkerServicer("cpu")
    servicer.attach(engine, identity=None, tokenizer=None)
    context = FakeContext()
    request = request or worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4)
    with pytest.raises(Aborted):
        async for _ in servicer.Generate(request, context):
            pass
    return context.status


@pytest.mark.parametrize(("error", "status"), [
    (InvalidRequestError("max_new_tokens", "too many"), (grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: too many")),
    (QueueFullError("waiting queue is full (8)"), (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (8)")),
    (EngineDeadError("CUDA error"), (grpc.StatusCode.UNAVAILABLE, "worker engine failed: CUDA error")),
])
async def test_generate_maps_each_engine_error_to_its_status(error, status):
    assert await generate_status(FakeEngine(error)) == status


async def test_a_request_ended_by_an_engine_failure_is_unavailable_like_a_dead_engine():
    output = SimpleNamespace(finish_reason=FinishReason.ERROR, error="CUDA error", finished=True)
    assert await generate_status(FakeEngine(output)) == (grpc.StatusCode.UNAVAILABLE, "worker engine failed: CUDA error")


async def test_an_invalid_request_is_refused_before_the_engine_sees_it():
    request = worker_pb2.GenerateRequest(max_new_tokens=4)
    assert await generate_status(FakeEngine(AssertionError("not reached")), request) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt: set prompt_token_ids or prompt_text")


async def test_watch_state_refuses_an_interval_out_of_range_naming_the_field():
    servicer = WorkerServicer("cpu")
    context = FakeContext()
    with pytest.raises(Aborted):
        async for _ in servicer.WatchState(worker_pb2.WatchStateRequest(interval_s=1000), context):
            pass
    assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, "interval_s: must be 0 or within [0.01, 60.0], got 1000.0")


class ImmediateEngine:
    """Queues every sample at once; each yields one token as soon as it is queued."""

    def __init__(self):
        self.first_output = asyncio.Event()

    async def generate(self, request, on_queued=None):
        if on_queued is not None:
            await on_queued()
        self.first_output.set()
        yield SimpleNamespace(finish_reason=None, finished=False, token_ids=[7], text="x", logprobs=[],
                              prompt_logprobs=[])


class StagedEngine(ImmediateEngine):
    """Queues a later sample only once the first has an output, as the vLLM engine does (it reuses the first
    sample's computed prompt)."""

    async def generate(self, request, on_queued=None):
        if request.shares_prompt_with is not None:
            await self.first_output.wait()
        async for output in super().generate(request, on_queued):
            yield output


@pytest.mark.parametrize("engine", [ImmediateEngine, StagedEngine])
async def test_no_sample_is_written_before_the_headers_of_a_call_with_n_samples(engine):
    """A call takes one write at a time: a sample's token sent while the headers are in flight fails the call."""
    writes = []

    class SlowHeadersContext(FakeContext):
        async def send_initial_metadata(self, metadata):
            writes.append("headers started")
            await asyncio.sleep(0.05)
            writes.append("headers sent")

    servicer = WorkerServicer("cpu")
    servicer.attach(engine(), identity=None, tokenizer=None)
    request = worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=[1, 2]), max_new_tokens=4, n=3)
    async with asyncio.timeout(10):  # a sample that waits on another's output must not wait forever
        async for response in servicer.Generate(request, SlowHeadersContext()):
            writes.append(f"sample {response.index}")
    assert writes[:2] == ["headers started", "headers sent"]
    assert sorted(writes[2:]) == ["sample 0", "sample 1", "sample 2"]
