"""Real worker and router processes on 127.0.0.1 for integration tests."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from tandem.launch import NOT_SERVING, SERVING, ServiceProcess  # noqa: F401  (re-exported for the tests)
from tandem.security import ClientTLS
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.device import TEST_DEVICE

REPO = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, str(REPO / "tests" / "integration" / "worker_harness.py")]  # a worker with faults injected


class WorkerProcess(ServiceProcess):
    """A worker serving ``model_dir`` with one torch thread and float32 weights for every step (so that its
    outputs compare token for token with transformers'), plus a Worker stub."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str, module: str = "cpu_worker",
                 launcher: list[str] | None = None, env: dict[str, str] | None = None, port: int | None = None,
                 tls: ClientTLS | None = None, host: str = "127.0.0.1"):
        args = ("--model", str(model_dir), "--threads", "1", "--decode-weights", "float32", *args)
        super().__init__(module, None if launcher else module, list(args), log_path, host=host, port=port,
                         command=launcher, env={"PYTHONPATH": str(REPO), **(env or {})}, tls=tls)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)


@contextlib.contextmanager
def running_worker(model_dir: Path, log_path: Path, *args: str, module_kind: str = "cpu"):
    """A healthy worker for the duration of the block; fails the block if the worker died meanwhile.

    ``module_kind="gpu"`` runs gpu_worker in fp32 on the test device (the CPU unless TANDEM_TEST_DEVICE says).
    """
    if module_kind == "gpu":
        args = ("--device", TEST_DEVICE, "--dtype", "float32", *args)
    with healthy(WorkerProcess(model_dir, log_path, *args, module=f"{module_kind}_worker")) as process:
        yield process


@contextlib.contextmanager
def healthy(process: WorkerProcess):
    """``process`` once healthy, for the duration of the block; fails the block if it died meanwhile."""
    try:
        process.wait_for_health()
        yield process
        assert process.alive, f"worker died during the tests:\n{process.log()}"
    finally:
        process.close()


class RouterProcess(ServiceProcess):
    """A router in front of ``workers`` (``NAME=KIND@HOST:PORT`` specs), plus a Router stub."""

    def __init__(self, model_dir: Path, log_path: Path, workers: list[str], *args: str,
                 env: dict[str, str] | None = None, tls: ClientTLS | None = None):
        worker_args = [arg for spec in workers for arg in ("--worker", spec)]
        # No HTTP front end unless a test asks for one (--http-port wins over the variable).
        super().__init__("router_svc", "router_svc", ["--model", str(model_dir), *worker_args, *args], log_path,
                         env={"PYTHONPATH": str(REPO), "TANDEM_HTTP_PORT": "0", **(env or {})}, tls=tls)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def wait_for_backends(self, healthy: set[str], timeout: float = 60.0, metadata=()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                backends = self.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=2, metadata=metadata).backends
                if {b.name for b in backends if b.healthy} == healthy:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"router did not see {healthy} healthy within {timeout} s:\n{self.log()}")


@contextlib.contextmanager
def serving_router(router: RouterProcess, names: set[str]):
    """``router`` once it serves and sees every worker of ``names`` healthy, for the duration of the block; fails
    the block if it died meanwhile."""
    try:
        router.wait_for_health(SERVING)
        router.wait_for_backends(names)
        yield router
        assert router.alive, router.log()
    finally:
        router.close()


def occupy(worker: WorkerProcess, request_id: str, max_new_tokens: int) -> grpc.Call:
    """A long generation sent to the worker directly (the router does not know it), read to its end by a
    thread; returns its call."""
    call = worker.stub.Generate(worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=worker_pb2.TokenIds(ids=list(range(200, 220))),
        max_new_tokens=max_new_tokens, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=120)
    threading.Thread(target=lambda: [None for _ in drained(call)], daemon=True).start()
    return call


def drained(call):
    try:
        yield from call
    except grpc.RpcError:
        return


def worker_state(worker: WorkerProcess) -> common_pb2.BackendState:
    """The worker's state snapshot, the first message of WatchState (asking no Estimate)."""
    call = worker.stub.WatchState(worker_pb2.WatchStateRequest(), timeout=5)
    state = next(call)
    call.cancel()
    return state


def worker_load(worker: WorkerProcess) -> tuple[int, int]:
    """(running, waiting) requests on the worker, from its state snapshot."""
    state = worker_state(worker)
    return state.num_running, state.num_waiting


def seen_by_router(router: RouterProcess) -> dict[str, tuple[int, int]]:
    """(running, waiting) requests on each worker as the router's latest snapshots show them."""
    backends = router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends
    return {b.name: (b.state.num_running, b.state.num_waiting) for b in backends}


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid``."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    below, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        below += children
        frontier = children
    return below


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Stall:
    """The worker's child processes (a vLLM worker's engine core) stopped: its steps stall while the worker
    itself still answers, as a busy accelerator would leave it."""

    def __init__(self, worker: WorkerProcess):
        self.children = descendants(worker.process.pid)

    def signal(self, number: int) -> None:
        for pid in self.children:
            os.kill(pid, number)

    def pulse(self, seconds: float) -> None:
        """Let the children run for about ``seconds``: timed by a shell of its own, which a busy test process (its
        threads, the GIL) cannot hold back while the children run on, at a real-time priority where the tests
        may use one: on a loaded machine the scheduler left an ordinary one waiting for seconds."""
        if not self.children:
            return time.sleep(seconds)
        pids = " ".join(map(str, self.children))
        subprocess.run([*_realtime(), "sh", "-c", f"kill -CONT {pids}; sleep {seconds}; kill -STOP {pids}"], check=True)

    def step_until(self, predicate, pulse_s: float = 0.005, timeout: float = 30.0):
        """Let the children run for pulses of ``pulse_s`` until ``predicate`` holds with them stopped again (a
        worker without children runs on its own); returns what ``predicate`` returned. Each pulse after which
        it does not hold is followed by one twice as long, up to 0.2 s: a loaded or slower machine gives the
        children less work done in a pulse."""
        deadline = time.monotonic() + timeout
        length = pulse_s
        while time.monotonic() < deadline:
            settle = time.monotonic() + 0.2  # what the children sent before they stopped reaches the worker
            while time.monotonic() < settle:
                value = predicate()
                if value:
                    return value
                time.sleep(0.02)
            self.pulse(length)
            length = min(2 * length, 0.2)
        raise AssertionError("condition not reached")


@functools.cache
def _realtime() -> tuple[str, ...]:
    """The prefix that runs a command at a real-time priority, or none where that is not permitted."""
    try:
        allowed = subprocess.run(["chrt", "--fifo", "1", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:  # no chrt here
        allowed = False
    return ("chrt", "--fifo", "1") if allowed else ()


@contextlib.contextmanager
def stopped(*workers: WorkerProcess):
    """The workers' own processes stopped (SIGSTOP) for the block: connections open, nothing answered."""
    for worker in workers:
        os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for worker in workers:
            os.kill(worker.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def stalled(worker: WorkerProcess):
    """A ``Stall`` of the worker for the block."""
    stall = Stall(worker)
    stall.signal(signal.SIGSTOP)
    try:
        yield stall
    finally:
        stall.signal(signal.SIGCONT)


def scrape_metrics(process: ServiceProcess) -> dict[tuple[str, tuple], float]:
    """The process's /metrics (it was started with --metrics-port), parsed as Prometheus text."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = process.args[process.args.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(predicate, timeout: float = 15.0):
    """Poll ``predicate`` until it returns something truthy, and return that; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def wait_for(get, expected, timeout: float = 15.0) -> None:
    """Poll ``get()`` until it returns ``expected``; fail after ``timeout``, naming what it returned last."""
    deadline = time.monotonic() + timeout
    while (value := get()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {expected!r}, last saw {value!r}")
        time.sleep(0.02)
