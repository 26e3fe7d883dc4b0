"""Workers joining and leaving a serving router, under load: found by DNS (a name whose answers change, from a
DNS server run by the test) and by watching pods (kubernetes_asyncio against a fake API server). Every server
is on the loopback: the DNS name's two addresses are 127.0.0.1 and ::1, with the workers on the same port."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from tandem.launch import free_port
from tandem.v1 import common_pb2, router_pb2, worker_pb2
from tests.fakes import ChangingDns, FakeKubernetesApi, pod
from tests.integration.workers import SERVING, RouterProcess, WorkerProcess, scrape_metrics, wait_until

pytestmark = pytest.mark.slow

NAME = "workers.tandem.test"
JOIN_WITHIN_S = 2.0


class Load:
    """Clients sending short requests through the router until stopped: when each was routed, to which
    worker, and how it ended."""

    def __init__(self, router: RouterProcess, clients: int = 3):
        self.router = router
        self.outcomes: list[tuple[float, str, str]] = []  # (routed at, worker or "", status)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(30, 60))),
                                          max_new_tokens=6, ignore_eos=True,
                                          sampling=common_pb2.SamplingParams(temperature=0.0))
        while not self._stop.is_set():
            routed_at, worker = time.monotonic(), ""
            try:
                tokens = 0
                for response in self.router.stub.Generate(request, timeout=30):
                    if response.HasField("decision"):
                        routed_at, worker = time.monotonic(), response.decision.chosen_worker
                    tokens += len(response.token_ids)
                self.outcomes.append((routed_at, worker, "OK" if tokens == 6 else f"{tokens} tokens"))
            except grpc.RpcError as exc:
                self.outcomes.append((routed_at, worker, f"{exc.code().name}: {exc.details()}"))

    def served_by(self, worker: str, after: float) -> float | None:
        """When the first request routed to ``worker`` after ``after`` was routed."""
        return next((t for t, w, _ in list(self.outcomes) if w == worker and t > after), None)

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def backends(router: RouterProcess) -> dict[str, router_pb2.Backend]:
    return {b.name: b for b in router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5).backends}


def membership_changes(router: RouterProcess) -> dict[str, float]:
    return {dict(labels)["change"]: value for (name, labels), value in scrape_metrics(router).items()
            if name == "tandem_router_membership_changes_total"}


@contextlib.contextmanager
def processes(*items):
    try:
        yield
    finally:
        for process in items:
            if process is not None:
                process.close()


def join_and_leave_under_load(router: RouterProcess, first: str, second: str, join, leave) -> None:
    """``first`` serves; ``join()`` adds ``second``, which gets requests within 2 s; ``leave()`` takes ``first``
    away while requests stream on it, and none is lost."""
    router.wait_for_backends({first})
    with Load(router) as load:
        wait_until(lambda: load.served_by(first, 0), timeout=30)
        joined_at = time.monotonic()
        join()
        routed = wait_until(lambda: load.served_by(second, joined_at), timeout=30)
        assert routed - joined_at < JOIN_WITHIN_S, f"first request to {second} {routed - joined_at:.2f} s after it joined"
        left_at = time.monotonic()
        leave()
        wait_until(lambda: first not in backends(router), timeout=30)
        after_leave = time.monotonic()
        wait_until(lambda: load.served_by(second, after_leave + 0.5), timeout=30)
    failed = [o for o in load.outcomes if o[2] != "OK"]
    assert not failed, f"requests lost while workers joined and left: {failed[:5]}"
    assert not any(w == first and t > after_leave + 0.5 for t, w, _ in load.outcomes), "a request went to a worker that left"
    assert len(load.outcomes) > 10 and load.served_by(first, left_at - 10) is not None
    assert membership_changes(router) == {"join": 2.0, "leave": 1.0}


def test_dns_discovery_join_and_leave_under_load(tiny_llama, tmp_path):
    port = free_port()
    ipv4 = WorkerProcess(tiny_llama, tmp_path / "worker-v4.log", port=port)
    ipv6 = WorkerProcess(tiny_llama, tmp_path / "worker-v6.log", host="[::1]", port=port)
    with ChangingDns(NAME, ["127.0.0.1"]) as dns, processes(ipv4, ipv6):
        ipv4.wait_for_health()
        ipv6.wait_for_health()
        router = RouterProcess(tiny_llama, tmp_path / "router.log", [], "--discover", f"dns:{NAME}:{port}:cpu",
                               "--dns-server", dns.address, "--discover-interval-s", "0.5", "--policy", "round_robin",
                               "--metrics-port", str(free_port()))
        with processes(router):
            router.wait_for_health(SERVING)
            join_and_leave_under_load(router, f"{NAME}@127.0.0.1", f"{NAME}@::1",
                                      join=lambda: dns.set(["127.0.0.1", "::1"]), leave=lambda: dns.set(["::1"]))
            assert backends(router)[f"{NAME}@::1"].source == f"dns:{NAME}:{port}:cpu"

            dns.set([])  # the name stops resolving: the router keeps the worker it has, and says so
            wait_until(lambda: scrape_metrics(router).get(
                ("tandem_router_discovery_up", (("source", f"dns:{NAME}:{port}:cpu"),))) == 0, timeout=10)
            assert set(backends(router)) == {f"{NAME}@::1"}
            responses = list(router.stub.Generate(router_pb2.RouteRequest(prompt_text="still serving", max_new_tokens=2),
                                                  timeout=30))
            assert responses[0].decision.chosen_worker == f"{NAME}@::1"
            assert router.log().count("keeping the last known workers") == 1


def test_kubernetes_discovery_join_and_leave_under_load(tiny_llama, tmp_path):
    first = WorkerProcess(tiny_llama, tmp_path / "worker-a.log")
    second = WorkerProcess(tiny_llama, tmp_path / "worker-b.log")
    with FakeKubernetesApi() as api, processes(first, second):
        api.put(pod("tandem-cpu-a", first.port))
        api.put(pod("tandem-cpu-b", second.port, ready=False))
        api.put(pod("tandem-odd", second.port, kind="tpu"))
        first.wait_for_health()
        second.wait_for_health()
        router = RouterProcess(tiny_llama, tmp_path / "router.log", [], "--discover", "k8s", "--namespace", "tandem",
                               "--policy", "round_robin", "--metrics-port", str(free_port()),
                               env={"KUBECONFIG": str(api.kubeconfig(tmp_path))})
        with processes(router):
            router.wait_for_health(SERVING)
            join_and_leave_under_load(router, "tandem-cpu-a", "tandem-cpu-b",
                                      join=lambda: api.put(pod("tandem-cpu-b", second.port)),
                                      leave=lambda: api.delete("tandem-cpu-a"))
            assert set(backends(router)) == {"tandem-cpu-b"} and backends(router)["tandem-cpu-b"].source == "k8s"
            assert "pod tandem/tandem-odd skipped: unknown kind" in router.log()
