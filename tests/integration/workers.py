"""Real worker processes on 127.0.0.1 for integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerProcess:
    """A worker subprocess (``python -m <module> ...``) with its log in ``log_path``."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str, module: str = "cpu_worker", launcher: list[str] | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        command = launcher or [sys.executable, "-m", module]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port), "--model", str(model_dir), "--threads", "1", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def health_status(self, service: str = "") -> int | None:
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_for_health(self, status: int = SERVING, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()}")
            if self.health_status() == status:
                return
            time.sleep(0.05)
        raise AssertionError(f"worker did not reach health {status} in {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.channel.close()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@contextlib.contextmanager
def running_worker(model_dir: Path, log_path: Path, *args: str):
    """A healthy worker for the duration of the block; fails the block if the worker died meanwhile."""
    process = WorkerProcess(model_dir, log_path, *args)
    try:
        process.wait_for_health()
        yield process
        assert process.process.poll() is None, f"worker died during the tests:\n{process.log()}"
    finally:
        process.close()
