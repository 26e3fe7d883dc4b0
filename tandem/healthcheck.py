"""A gRPC health probe for container healthchecks: ``python -m tandem.healthcheck HOST:PORT``.

Exits 0 when the server answers SERVING, 1 otherwise.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tandem.healthcheck HOST:PORT", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args[0]) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            print(f"{args[0]}: {exc.code().name}", file=sys.stderr)
            return 1
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{args[0]}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
