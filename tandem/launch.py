"""Start Tandem services as local processes and wait for their gRPC health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.security import ClientTLS, channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """One service (``python -m <module> ...``) listening on ``host:port``, its output in ``log_path``.

    The service leads its own process group, so that killing it also kills what it started (a vLLM
    worker's engine-core processes).

    Args:
        module: the module to run, or None with ``command`` for any other launcher.
        args: flags after the module; ``--host`` and ``--port`` are added.
        tls: how to reach a service that serves TLS (health checks and stubs use ``channel``).
    """

    def __init__(self, name: str, module: str | None, args: list[str], log_path: Path, host: str = "127.0.0.1",
                 port: int | None = None, command: list[str] | None = None, env: dict[str, str] | None = None,
                 tls: ClientTLS | None = None):
        self.name = name
        self.args = list(args)
        self.host = host
        self.port = port or free_port(host)
        self.address = f"{host}:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        launcher = command or [sys.executable, "-m", module]
        self.process = subprocess.Popen(
            [*launcher, "--host", host, "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.channel = channel(self.address, tls)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def health_status(self, service: str = "") -> int | None:
        try:
            return self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_for_health(self, status: int = SERVING, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}; log:\n{self.log()}")
            if self.health_status() == status:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not reach health {status} within {timeout:.0f} s; log:\n{self.log()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait up to ``timeout`` (then SIGKILL); returns the exit code."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode
        finally:
            self.close()

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the service and every process of its group; wait up to ``timeout`` for the group to end."""
        deadline = time.monotonic() + timeout
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            while time.monotonic() < deadline:
                os.killpg(self.process.pid, 0)
                time.sleep(0.02)
        except ProcessLookupError:
            self.process.wait()

    def close(self) -> None:
        self.kill()
        self.channel.close()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
