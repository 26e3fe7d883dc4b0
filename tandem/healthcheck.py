"""A gRPC health probe for container healthchecks: ``python -m tandem.healthcheck HOST:PORT``.

Exits 0 when the server answers SERVING, 1 otherwise. ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
for servers that require client certificates) probe over TLS.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.security import channel, client_tls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.healthcheck")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("--tls-ca", help="PEM CA of the server's certificate")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    args = parser.parse_args(argv)
    try:
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        parser.error(str(exc))
    with channel(args.address, tls) as probe:
        try:
            response = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}", file=sys.stderr)
            return 1
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
