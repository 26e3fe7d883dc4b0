"""Stand-ins for outside systems that cannot run here, served on 127.0.0.1 and spoken to by the real clients:
a DNS server whose answers a test changes (dnspython asks it), and a Kubernetes API server that lists and
watches pods (kubernetes_asyncio talks to it through a kubeconfig file)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import threading
from pathlib import Path

from aiohttp import web
from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class ChangingDns(BaseResolver):
    """Answers A and AAAA queries for ``name`` with the addresses last set; a name with none is NXDOMAIN."""

    def __init__(self, name: str, addresses: list[str]):
        self.name = name.rstrip(".") + "."
        self.addresses = list(addresses)
        self.queries = 0
        self._server = DNSServer(self, address="127.0.0.1", port=0, logger=DNSLogger("-request,-reply,-truncated"))
        self.address = "127.0.0.1:%d" % self._server.server.server_address[1]

    def set(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)

    def resolve(self, request, handler):
        self.queries += 1
        reply = request.reply()
        question = request.q
        if str(question.qname) != self.name or not self.addresses:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for address in self.addresses:
            ip = ipaddress.ip_address(address)
            if question.qtype == QTYPE.A and ip.version == 4:
                reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(address), ttl=1))
            elif question.qtype == QTYPE.AAAA and ip.version == 6:
                reply.add_answer(RR(question.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=1))
        return reply

    def __enter__(self) -> "ChangingDns":
        self._server.start_thread()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()
        self._server.server.server_close()


def pod(name: str, port: int, kind: str | None = "cpu", ready: bool = True, port_name: str = "grpc",
        ip: str = "127.0.0.1", labels: dict | None = None) -> dict:
    """A worker pod as the API server returns it."""
    pod_labels = {"app.kubernetes.io/part-of": "tandem", "app.kubernetes.io/component": "worker", **(labels or {})}
    if kind is not None:
        pod_labels["tandem.dev/worker-kind"] = kind
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "tandem", "labels": pod_labels, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "worker", "image": "tandem:latest",
                                 "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class FakeKubernetesApi:
    """The pod list and watch endpoints of a Kubernetes API server, for one namespace.

    ``put`` and ``delete`` change the pods and send ADDED, MODIFIED or DELETED to every open watch; a watch
    from a resourceVersion first gets every event after it, as the real server replays them.
    ``failing`` makes every call answer 500 (and ends open watches), as an API server in trouble.
    """

    def __init__(self, namespace: str = "tandem"):
        self.namespace = namespace
        self.pods: dict[str, dict] = {}
        self.failing = False
        self.requests: list[str] = []
        self._version = 1
        self._events: list[tuple[int, dict]] = []
        self._watches: list[asyncio.Queue] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": self.namespace}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        }))
        return path

    def put(self, manifest: dict) -> None:
        self._call(self._change, "MODIFIED" if manifest["metadata"]["name"] in self.pods else "ADDED", manifest)

    def delete(self, name: str) -> None:
        self._call(self._change, "DELETED", self.pods[name])

    def fail(self, failing: bool) -> None:
        self._call(self._set_failing, failing)

    def __enter__(self) -> "FakeKubernetesApi":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        self._call(self._end_watches)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, function, *args) -> None:
        async def run():
            function(*args)
        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _change(self, event_type: str, manifest: dict) -> None:
        self._version += 1
        manifest = {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": str(self._version)}}
        if event_type == "DELETED":
            self.pods.pop(manifest["metadata"]["name"], None)
        else:
            self.pods[manifest["metadata"]["name"]] = manifest
        event = {"type": event_type, "object": manifest}
        self._events.append((self._version, event))
        for queue in self._watches:
            queue.put_nowait(event)

    def _set_failing(self, failing: bool) -> None:
        self.failing = failing
        if failing:
            self._end_watches()

    def _end_watches(self) -> None:
        for queue in self._watches:
            queue.put_nowait(None)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path_qs)
        if self.failing:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500,
                                      "reason": "InternalError", "message": "etcd is unavailable"}, status=500)
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": [],
                                      "metadata": {"resourceVersion": str(self._version)}})
        if request.query.get("watch") not in ("true", "True", "1"):
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": list(self.pods.values()),
                                      "metadata": {"resourceVersion": str(self._version)}})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        since = int(request.query.get("resourceVersion", self._version))
        for version, event in self._events:
            if version > since:
                queue.put_nowait(event)
        self._watches.append(queue)
        try:
            while (event := await queue.get()) is not None:
                await response.write(json.dumps(event).encode() + b"\n")
        finally:
            self._watches.remove(queue)
        return response
