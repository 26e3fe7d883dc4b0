"""GrpcService: a started service reports NOT_SERVING until it is told it serves (grpc's own health servicer
answers SERVING for the whole server from the start, which let a router pass a readiness check before any
worker had been seen)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.launch import free_port
from tandem.serving import GrpcService


def test_health_is_not_serving_from_the_start_until_set():
    async def statuses() -> list[int]:
        service = GrpcService("tandem.test.Nothing", "127.0.0.1", free_port())
        await service.start()
        try:
            async with grpc.aio.insecure_channel(service.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def check(name: str) -> int:
                    return (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status

                seen = [await check(""), await check(service.service_name)]
                await service.set_health(True)
                seen += [await check(""), await check(service.service_name)]
                return seen
        finally:
            await service.server.stop(None)

    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    assert asyncio.run(statuses()) == [NOT_SERVING, NOT_SERVING, SERVING, SERVING]
