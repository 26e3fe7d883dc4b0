"""What every Tandem gRPC service shares: the server with health and reflection, and the metrics port."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class GrpcService:
    """A grpc.aio server listening on ``host:port`` for ``service_name``, with health and reflection.

    Health starts NOT_SERVING; ``set_health`` sets it for the whole server and for ``service_name``.
    """

    def __init__(self, service_name: str, host: str, port: int, options: list[tuple[str, int]] | None = None):
        self.service_name = service_name
        self.address = f"{host}:{port}"
        self.server = grpc.aio.server(options=options or [])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((service_name, HEALTH_SERVICE, reflection.SERVICE_NAME), self.server)
        if self.server.add_insecure_port(self.address) == 0:
            raise OSError(f"cannot listen on {self.address}")

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", self.service_name):
            await self.health.set(service, status)


def serve_metrics(host: str, port: int) -> None:
    """Serve Prometheus metrics on ``host:port`` (a background thread); 0 disables them."""
    if not port:
        return
    from prometheus_client import start_http_server

    start_http_server(port, addr=host)
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, port)
