"""Workers that join and leave while the router runs: found by DNS names or by watching Kubernetes pods.

Each discovery keeps the registry's set of workers from its source equal to what it last saw. When a lookup
fails, the last known set stays: discovery failing never empties the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from router_svc import metrics
from router_svc.workers import WorkerAddress
from tandem.protocol import WORKER_KINDS

logger = logging.getLogger(__name__)

BACKOFF_MAX_S = 30.0
K8S_WATCH_TIMEOUT_S = 300
K8S_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_SELECTOR = "app.kubernetes.io/part-of=tandem,app.kubernetes.io/component=worker"
DEFAULT_KIND_LABEL = "tandem.dev/worker-kind"
DEFAULT_PORT_NAME = "grpc"
_DNS_SPEC = re.compile(r"^dns:(?P<name>[A-Za-z0-9_.-]+):(?P<port>\d{1,5}):(?P<kind>[a-z]+)$")


@dataclass(frozen=True)
class DiscoverySettings:
    """How discoveries look: every few seconds for DNS; which pods, labels and ports for Kubernetes."""

    interval_s: float = 1.0
    dns_server: str | None = None
    namespace: str | None = None
    selector: str = DEFAULT_SELECTOR
    kind_label: str = DEFAULT_KIND_LABEL
    port_name: str = DEFAULT_PORT_NAME


def parse_spec(spec: str) -> str:
    """Check one ``--discover`` value (``dns:NAME:PORT:KIND`` or ``k8s``) and return it normalised."""
    spec = spec.strip()
    if spec == "k8s":
        return spec
    match = _DNS_SPEC.match(spec)
    if match is None or match["kind"] not in WORKER_KINDS or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"discover {spec!r}: expected dns:NAME:PORT:KIND (KIND cpu or gpu) or k8s")
    return spec


def build(spec: str, settings: DiscoverySettings) -> "Discovery":
    if spec == "k8s":
        return KubernetesDiscovery(settings)
    match = _DNS_SPEC.match(spec)
    return DnsDiscovery(match["name"], int(match["port"]), match["kind"], settings)


class Discovery:
    """A source of workers. ``run`` keeps the registry's workers from ``source`` current until cancelled."""

    source: str

    def __init__(self):
        self._failing: str | None = None
        metrics.DISCOVERY_UP.labels(self.source).set(0)

    async def run(self, registry) -> None:
        raise NotImplementedError

    def succeeded(self) -> None:
        if self._failing is not None:
            logger.info("discovery %s works again", self.source)
        self._failing = None
        metrics.DISCOVERY_UP.labels(self.source).set(1)

    def failed(self, reason: str, retry_s: float) -> None:
        """Count the failure; log only when the state changes, so a long outage does not flood the log."""
        metrics.DISCOVERY_ERRORS.labels(self.source).inc()
        metrics.DISCOVERY_UP.labels(self.source).set(0)
        if self._failing != reason:
            logger.warning("discovery %s failed (%s); keeping the last known workers, retrying in %.1f s and backing "
                           "off up to %.0f s", self.source, reason, retry_s, BACKOFF_MAX_S)
        self._failing = reason


class DnsDiscovery(Discovery):
    """Every address of ``name`` is a worker of ``kind`` on ``port``: a Kubernetes headless Service, or a
    compose service scaled with ``--scale``. The name is re-resolved every ``interval_s`` seconds."""

    def __init__(self, name: str, port: int, kind: str, settings: DiscoverySettings):
        self.name, self.port, self.kind = name, port, kind
        self.source = f"dns:{name}:{port}:{kind}"
        self.interval_s = settings.interval_s
        self._resolver = _resolver(settings.dns_server)
        super().__init__()

    async def addresses(self) -> list[WorkerAddress]:
        """The workers the name stands for now. Raises dns.exception.DNSException when it resolves to nothing."""
        import dns.exception
        import dns.resolver

        found: list[str] = []
        errors = []
        for record_type in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(self.name, record_type, search=True)
                found.extend(record.address for record in answer)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN) as exc:
                errors.append(exc)
        if not found:
            raise errors[0] if errors else dns.exception.DNSException(f"{self.name} has no address")
        return [WorkerAddress(f"{self.name}@{ip}", self.kind, _host(ip), self.port) for ip in sorted(set(found))]

    async def run(self, registry) -> None:
        import dns.exception

        delay = self.interval_s
        while True:
            try:
                registry.reconcile(self.source, await self.addresses())
            except dns.exception.DNSException as exc:
                delay = min(delay * 2, BACKOFF_MAX_S)
                self.failed(f"{type(exc).__name__}: {exc}", delay)
            else:
                self.succeeded()
                delay = self.interval_s
            await asyncio.sleep(delay)


class KubernetesDiscovery(Discovery):
    """Pods in ``namespace`` matching ``selector``, watched through the Kubernetes API.

    A pod is a worker once it is Ready (and not being deleted): its kind from label ``kind_label``, its port
    from the container port named ``port_name``, its address the pod IP, its name the pod's. It leaves when
    it stops being Ready or is deleted. The API is reached from inside a cluster with the pod's service
    account, otherwise with the kubeconfig (``KUBECONFIG`` or ~/.kube/config).
    """

    source = "k8s"

    def __init__(self, settings: DiscoverySettings):
        self.namespace = settings.namespace or _own_namespace()
        self.selector = settings.selector
        self.kind_label = settings.kind_label
        self.port_name = settings.port_name
        self.initial_backoff_s = settings.interval_s
        self._pods: dict[str, object] = {}
        self._skipped: dict[str, str] = {}
        super().__init__()

    async def run(self, registry) -> None:
        from kubernetes_asyncio import client, watch

        delay = self.initial_backoff_s
        api = None
        while True:
            try:
                api = api or await _api_client()
                pods = client.CoreV1Api(api)
                listed = await pods.list_namespaced_pod(self.namespace, label_selector=self.selector)
                self._pods = {pod.metadata.name: pod for pod in listed.items}
                registry.reconcile(self.source, self.addresses())
                self.succeeded()
                delay = self.initial_backoff_s
                async with watch.Watch() as events:
                    async for event in events.stream(pods.list_namespaced_pod, self.namespace,
                                                     label_selector=self.selector,
                                                     resource_version=listed.metadata.resource_version,
                                                     timeout_seconds=K8S_WATCH_TIMEOUT_S):
                        self.apply(event["type"], event["object"])
                        registry.reconcile(self.source, self.addresses())
            except asyncio.CancelledError:
                if api is not None:
                    await api.close()
                raise
            except Exception as exc:  # the API server unreachable or answering errors: keep the last known pods
                delay = min(delay * 2, BACKOFF_MAX_S)
                self.failed(_describe_api_error(exc), delay)
                await asyncio.sleep(delay)

    def apply(self, event_type: str, pod) -> None:
        if event_type == "DELETED":
            self._pods.pop(pod.metadata.name, None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._pods[pod.metadata.name] = pod

    def addresses(self) -> list[WorkerAddress]:
        """The Ready pods that name a known kind and the port, as workers."""
        found = []
        for name, pod in self._pods.items():
            if not _ready(pod):
                continue
            address, problem = self._address(pod)
            if problem is not None:
                if self._skipped.get(name) != problem:
                    logger.warning("pod %s/%s skipped: %s", self.namespace, name, problem)
                    metrics.WORKERS_REFUSED.labels(self.source, problem.split(":")[0]).inc()
                self._skipped[name] = problem
                continue
            self._skipped.pop(name, None)
            found.append(address)
        return found

    def _address(self, pod) -> tuple[WorkerAddress | None, str | None]:
        kind = (pod.metadata.labels or {}).get(self.kind_label)
        if kind not in WORKER_KINDS:
            return None, f"unknown kind: label {self.kind_label}={kind!r}, expected one of {', '.join(WORKER_KINDS)}"
        ports = [port.container_port for container in pod.spec.containers for port in (container.ports or [])
                 if port.name == self.port_name]
        if not ports:
            return None, f"no port: no container port named {self.port_name!r}"
        return WorkerAddress(pod.metadata.name, kind, _host(pod.status.pod_ip), ports[0]), None


def _ready(pod) -> bool:
    if pod.metadata.deletion_timestamp is not None or not pod.status or not pod.status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


async def _api_client():
    from kubernetes_asyncio import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    return client.ApiClient()


def _describe_api_error(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else f"{type(exc).__name__}: {exc}"


def _own_namespace() -> str:
    try:
        return K8S_NAMESPACE_FILE.read_text().strip()
    except OSError:
        return "default"


def _resolver(dns_server: str | None):
    """dnspython's resolver: the system's configuration, or only ``dns_server`` (HOST or HOST:PORT)."""
    import dns.asyncresolver

    if dns_server is None:
        return dns.asyncresolver.Resolver()
    host, _, port = dns_server.rpartition(":") if dns_server.count(":") == 1 else (dns_server, "", "")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host or dns_server]
    resolver.port = int(port) if port else 53
    resolver.lifetime = 2.0
    return resolver


def _host(ip: str) -> str:
    return f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
