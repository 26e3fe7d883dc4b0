"""Discovery against a real DNS server and a fake Kubernetes API server (both on 127.0.0.1), and the
registry's membership: joins, leaves, drains. No workers run here; tests/integration/test_discovery.py has them."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from router_svc import discovery
from router_svc.config import parse_config
from router_svc.prefix_index import PromptBlocks
from router_svc.workers import WorkerAddress, WorkerRegistry
from tests.fakes import ChangingDns, FakeKubernetesApi, pod

NAME = "workers.tandem.test"


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def until(predicate, timeout: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def members(registry: WorkerRegistry) -> dict[str, str]:
    return {name: backend.address.address for name, backend in registry.workers.items()}


@pytest.mark.parametrize("spec", ["dns:cpu-worker:50061:cpu", "dns:a.b.svc.cluster.local:1:gpu", "k8s"])
def test_discover_specs_are_accepted(spec):
    assert parse_config(["--discover", spec]).discover == (spec,)


@pytest.mark.parametrize("spec", ["dns:cpu-worker:50061", "dns:cpu-worker:50061:tpu", "dns:x:0:cpu", "dns:x:70000:cpu",
                                  "consul:x", "dns:bad name:1:cpu"])
def test_bad_discover_specs_name_the_field(spec, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--discover", spec])
    assert "discover" in capsys.readouterr().err


def test_a_router_needs_workers_or_discovery(capsys):
    with pytest.raises(SystemExit):
        parse_config([])
    assert "--discover" in capsys.readouterr().err


def test_discovery_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_DISCOVER", "dns:cpu-worker:50061:cpu, dns:gpu-worker:50062:gpu")
    monkeypatch.setenv("TANDEM_SELECTOR", "app=tandem")
    config = parse_config([])
    assert config.discover == ("dns:cpu-worker:50061:cpu", "dns:gpu-worker:50062:gpu")
    assert config.discovery.selector == "app=tandem"


async def test_registry_membership_join_leave_and_drain():
    registry = WorkerRegistry([WorkerAddress("static", "gpu", "127.0.0.1", 1)])
    first, second = WorkerAddress("w@10.0.0.1", "cpu", "10.0.0.1", 2), WorkerAddress("w@10.0.0.2", "cpu", "10.0.0.2", 2)
    joins = sample("tandem_router_membership_changes_total", source="dns:w", change="join")
    registry.reconcile("dns:w", [first, second])
    assert set(registry.workers) == {"static", "w@10.0.0.1", "w@10.0.0.2"}
    assert sample("tandem_router_membership_changes_total", source="dns:w", change="join") == joins + 2
    assert sample("tandem_router_workers", kind="cpu") == 2

    leaving = registry.workers["w@10.0.0.1"]
    leaving.dispatch("r1", PromptBlocks([]), 10, 5)
    registry.reconcile("dns:w", [second])
    assert "w@10.0.0.1" not in registry.workers and leaving in registry.draining
    assert not leaving.healthy and leaving.describe() == "leaving (1 in flight)"
    assert leaving.message().status == "leaving (1 in flight)" and leaving.message().source == "dns:w"
    assert [b.name for b in registry.listed()] == ["static", "w@10.0.0.2", "w@10.0.0.1"]
    leaving.release("r1")  # its last stream ended: gone
    assert leaving not in registry.draining and [b.name for b in registry.listed()] == ["static", "w@10.0.0.2"]

    registry.reconcile("k8s", [WorkerAddress("static", "cpu", "10.0.0.9", 3)])  # a name another source holds
    assert registry.workers["static"].source == "static"
    registry.reconcile("dns:w", [])
    assert set(registry.workers) == {"static"}
    await registry.stop()


async def test_dns_discovery_follows_the_answers_and_keeps_the_last_on_failure(caplog):
    caplog.set_level(logging.INFO, logger="router_svc.discovery")
    with ChangingDns(NAME, ["127.0.0.1"]) as dns:
        settings = discovery.DiscoverySettings(interval_s=0.05, dns_server=dns.address)
        source = discovery.build(f"dns:{NAME}:5000:cpu", settings)
        registry = WorkerRegistry([])
        registry.start([source])
        await until(lambda: members(registry) == {f"{NAME}@127.0.0.1": "127.0.0.1:5000"})
        assert sample("tandem_router_discovery_up", source=source.source) == 1

        dns.set(["127.0.0.1", "::1"])
        await until(lambda: len(registry.workers) == 2)
        assert registry.workers[f"{NAME}@::1"].address.address == "[::1]:5000"

        dns.set([])  # NXDOMAIN: the name no longer resolves; the pool stays as it was
        errors = sample("tandem_router_discovery_errors_total", source=source.source)
        await until(lambda: sample("tandem_router_discovery_errors_total", source=source.source) >= errors + 3,
                    timeout=10)
        assert len(registry.workers) == 2 and sample("tandem_router_discovery_up", source=source.source) == 0
        failures = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(failures) == 1 and "NXDOMAIN" in failures[0].getMessage()  # logged once, not per retry

        dns.set(["::1"])
        await until(lambda: set(registry.workers) == {f"{NAME}@::1"}, timeout=10)
        assert any("works again" in r.getMessage() for r in caplog.records)
        await registry.stop()


async def test_kubernetes_discovery_admits_ready_pods_and_skips_bad_ones(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="router_svc.discovery")
    with FakeKubernetesApi() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        api.put(pod("cpu-a", 6001))
        api.put(pod("cpu-b", 6002, ready=False))
        source = discovery.build("k8s", discovery.DiscoverySettings(interval_s=0.05, namespace="tandem"))
        registry = WorkerRegistry([])
        registry.start([source])
        await until(lambda: members(registry) == {"cpu-a": "127.0.0.1:6001"})
        assert "labelSelector=app.kubernetes.io" in api.requests[0]

        api.put(pod("cpu-b", 6002))  # MODIFIED: Ready now
        await until(lambda: set(registry.workers) == {"cpu-a", "cpu-b"})
        api.put(pod("gpu-a", 6003, kind="gpu", ip="fd00::5"))
        await until(lambda: "gpu-a" in registry.workers)
        assert registry.workers["gpu-a"].kind == "gpu" and registry.workers["gpu-a"].address.address == "[fd00::5]:6003"

        skipped = sample("tandem_router_workers_refused_total", source="k8s", reason="unknown kind")
        api.put(pod("odd-kind", 6004, kind="tpu"))
        api.put(pod("no-port", 6005, port_name="metrics"))
        api.put(pod("no-label", 6006, kind=None))
        await until(lambda: sample("tandem_router_workers_refused_total", source="k8s", reason="unknown kind")
                    == skipped + 2)
        assert sample("tandem_router_workers_refused_total", source="k8s", reason="no port") >= 1
        assert not {"odd-kind", "no-port", "no-label"} & set(registry.workers)
        assert sum("skipped" in r.getMessage() for r in caplog.records) == 3

        api.put(pod("cpu-b", 6002, ready=False))  # not Ready any more: leaves
        api.delete("cpu-a")
        await until(lambda: set(registry.workers) == {"gpu-a"})

        api.fail(True)  # the API server fails: the pool stays, the failure is counted and retried
        errors = sample("tandem_router_discovery_errors_total", source="k8s")
        await until(lambda: sample("tandem_router_discovery_errors_total", source="k8s") >= errors + 2, timeout=10)
        assert set(registry.workers) == {"gpu-a"} and sample("tandem_router_discovery_up", source="k8s") == 0
        api.put(pod("cpu-c", 6007))
        api.fail(False)  # back: the relist brings in what changed meanwhile
        await until(lambda: set(registry.workers) == {"gpu-a", "cpu-c"}, timeout=10)
        assert sample("tandem_router_discovery_up", source="k8s") == 1
        await registry.stop()
