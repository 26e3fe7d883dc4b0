"""The router's ProbeStream against a real worker: answers matched in order, late answers dropped, a stalled
worker's queue capped, a dead worker's probes answered with None."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc

from router_svc.probes import ProbeStream
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.workers import WorkerProcess

PREFIX = list(range(200, 248))  # three full blocks of 16


def _probe(prompt: list[int]) -> worker_pb2.EstimateRequest:
    return worker_pb2.EstimateRequest(prompt_token_ids=prompt)


def _warm(worker) -> None:
    list(worker.stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=worker_pb2.TokenIds(ids=PREFIX + [1]),
                                                         max_new_tokens=1), timeout=60))


def _with_probes(worker, body, **options):
    async def run():
        async with grpc.aio.insecure_channel(worker.address) as channel:
            probes = ProbeStream(worker_pb2_grpc.WorkerStub(channel), **options)
            try:
                return await body(probes)
            finally:
                probes.close()

    return asyncio.run(run())


def test_concurrent_probes_each_get_their_own_answer(worker):
    _warm(worker)
    prompts = [PREFIX + [2], [1, 2], PREFIX[:16] + [3]] * 5

    async def body(probes):
        return await asyncio.gather(*(probes.ask(_probe(prompt)) for prompt in prompts))

    assert [answer.cached_tokens for answer in _with_probes(worker, body)] == [48, 0, 16] * 5


def test_an_abandoned_probe_does_not_shift_the_answers(worker):
    _warm(worker)

    async def body(probes):
        abandoned = probes.ask(_probe(PREFIX + [2]))
        abandoned.cancel()
        cold = await probes.ask(_probe([1, 2]))
        warm = await probes.ask(_probe(PREFIX + [3]))
        return cold.cached_tokens, warm.cached_tokens

    assert _with_probes(worker, body) == (0, 48)


def test_a_stalled_worker_caps_the_pending_probes_and_a_dead_one_answers_none(tiny_llama, tmp_path):
    worker = WorkerProcess(tiny_llama, tmp_path / "worker.log")
    try:
        worker.wait_for_health()

        async def body(probes):
            assert (await probes.ask(_probe([1, 2]))) is not None  # the call is open
            os.kill(worker.process.pid, signal.SIGSTOP)
            try:
                waiting = [probes.ask(_probe([1, 2])) for _ in range(3)]
                refused = probes.ask(_probe([1, 2]))
                assert refused.done() and refused.result() is None
                done, _ = await asyncio.wait(waiting, timeout=0.3)
                assert not done
            finally:
                os.kill(worker.process.pid, signal.SIGCONT)
            assert all(answer is not None for answer in await asyncio.gather(*waiting))

            os.kill(worker.process.pid, signal.SIGSTOP)
            orphaned = probes.ask(_probe([1, 2]))
            worker.process.kill()
            assert await asyncio.wait_for(orphaned, timeout=10) is None
            assert probes.closed and probes.ask(_probe([1, 2])).result() is None

        _with_probes(worker, body, max_pending=3)
    finally:
        worker.close()
