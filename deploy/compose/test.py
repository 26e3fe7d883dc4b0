"""`make compose-test`: the compose stack for real, on this host's Docker engine.

Builds the CPU image (tandem:latest) with `docker compose build`, on a base image made with
debootstrap when python:3.11-slim cannot be pulled; starts the router, a CPU worker and the GPU
worker on the CPU (`gpu-worker-cpu`) with `docker compose up --no-deps`, so none of the
observability images is needed; sends requests through the published ports (gRPC with the tandem
CLI, the OpenAI HTTP API with curl); scales cpu-worker to 3 and checks that each of the three
replicas is routed requests, as the router's ListBackends counts them; then `docker compose down -v`.

Run it with the project's virtual environment (the gRPC client): `.venv/bin/python deploy/compose/test.py`.
Settings from the environment: TANDEM_BASE_IMAGE (default: python:3.11-slim if it can be had, else
tandem-base:bookworm made by base-image.sh), TANDEM_TORCH_INDEX (default none: the torch wheel comes
from wheels/, filled first by wheelhouse.sh), TANDEM_COMPOSE_TEST_CA (a CA bundle for the build; default:
the one this host's pip uses, if any; "none" for none).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = "tandem-compose-test"
SCALE = 3
BURST = 24            # concurrent requests once cpu-worker is scaled
MAX_NEW_TOKENS = 8
HEALTH_TIMEOUT_S = 600

sys.path.insert(0, str(REPO))


def log(message: str) -> None:
    print(f"[compose-test {time.monotonic() - START:6.1f}s] {message}", flush=True)


def run(command: list[str], env: dict | None = None, check: bool = True, capture: bool = False,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    shown = " ".join(command)
    log(f"$ {shown}")
    result = subprocess.run(command, cwd=REPO, env=env, text=True, timeout=timeout,
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if check and result.returncode != 0:
        if capture:
            print(result.stdout)
        raise SystemExit(f"compose-test: failed ({result.returncode}): {shown}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_image() -> str:
    """TANDEM_BASE_IMAGE, else python:3.11-slim when it is here or can be pulled, else tandem-base:bookworm."""
    if os.environ.get("TANDEM_BASE_IMAGE"):
        return os.environ["TANDEM_BASE_IMAGE"]
    slim = "python:3.11-slim"
    if run(["docker", "image", "inspect", slim], check=False, capture=True).returncode == 0:
        return slim
    if run(["docker", "pull", "-q", slim], check=False, capture=True, timeout=300).returncode == 0:
        return slim
    log(f"{slim} cannot be pulled here: making the base image with debootstrap")
    run([str(REPO / "deploy/compose/base-image.sh"), "tandem-base:bookworm"])
    return "tandem-base:bookworm"


def host_ca_bundle() -> Path | None:
    """The CA bundle this host's pip is configured with (PIP_CERT or pip's config), if any."""
    chosen = os.environ.get("TANDEM_COMPOSE_TEST_CA")
    if chosen:
        return None if chosen == "none" else Path(chosen)
    if os.environ.get("PIP_CERT"):
        return Path(os.environ["PIP_CERT"])
    result = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"],
                            capture_output=True, text=True)
    return Path(result.stdout.strip()) if result.returncode == 0 and result.stdout.strip() else None


class Stack:
    def __init__(self, env: dict):
        self.env = env
        self.compose = ["docker", "compose", "--progress", "plain", "-p", PROJECT, "-f", "docker-compose.yml",
                        "-f", "deploy/compose/test.override.yml"]

    def __call__(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return run([*self.compose, *args], env=self.env, **kwargs)

    def wait_healthy(self, expected: dict[str, int]) -> None:
        """Wait until each service has its expected number of healthy containers."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            containers = [c for c in self.containers() if c.get("Service") in expected]
            healthy = Counter(c["Service"] for c in containers if c.get("Health") == "healthy")
            if all(healthy[s] >= n for s, n in expected.items()):
                log(f"healthy: {dict(healthy)}")
                return
            dead = [c["Name"] for c in containers if c.get("State") in ("exited", "dead")]
            if dead or time.monotonic() > deadline:
                self("logs", "--tail", "40", check=False)
                raise SystemExit(f"compose-test: not healthy ({dict(healthy)} of {expected}); exited: {dead}")
            time.sleep(2)

    def containers(self) -> list[dict]:
        output = subprocess.run([*self.compose, "ps", "--all", "--format", "json"], cwd=REPO, env=self.env,
                                capture_output=True, text=True).stdout.strip()
        if not output:
            return []
        if output.startswith("["):
            return json.loads(output)
        return [json.loads(line) for line in output.splitlines() if line.strip()]

    def addresses(self, service: str) -> dict[str, str]:
        """Container IP address on the project network -> container name, for a service's replicas."""
        result = {}
        for container in self.containers():
            if container.get("Service") != service:
                continue
            inspect = json.loads(subprocess.run(["docker", "inspect", container["ID"]], capture_output=True,
                                                text=True, check=True).stdout)[0]
            for network in inspect["NetworkSettings"]["Networks"].values():
                result[network["IPAddress"]] = container["Name"]
        return result


def wait_router_backends(address: str, kind_counts: dict[str, int], timeout_s: float = 180):
    """Wait until the router lists kind_counts healthy backends of each kind; return them."""
    from tandem.client import RouterClient
    from tandem.v1 import common_pb2

    client = RouterClient(address)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                backends = client.backends(timeout=5).backends
            except Exception as exc:  # noqa: BLE001 - the router may still be starting
                backends, error = [], exc
            else:
                error = None
            healthy = Counter(common_pb2.WorkerKind.Name(b.kind).removeprefix("WORKER_KIND_").lower()
                              for b in backends if b.healthy)
            if all(healthy[k] >= n for k, n in kind_counts.items()):
                return backends
            if time.monotonic() > deadline:
                raise SystemExit(f"compose-test: the router lists {dict(healthy)} healthy, wanted {kind_counts}"
                                 f"{f' ({error})' if error else ''}")
            time.sleep(1)
    finally:
        client.close()


def cli(*args: str) -> str:
    result = run([sys.executable, "-m", "tandem.cli", *args], capture=True, check=False, timeout=120)
    print(result.stdout.rstrip())
    if result.returncode != 0:
        raise SystemExit(f"compose-test: tandem {args[0]} failed ({result.returncode})")
    return result.stdout


def curl(*args: str) -> str:
    result = run(["curl", "-sS", "--max-time", "120", "--fail-with-body", *args], capture=True, check=False)
    if result.returncode != 0:
        print(result.stdout)
        raise SystemExit(f"compose-test: curl failed ({result.returncode})")
    return result.stdout


def requests_through_the_ports(grpc_address: str, http_url: str) -> None:
    log("gRPC: tandem generate --explain through the published port")
    out = cli("generate", "--router", grpc_address, "--max-new-tokens", str(MAX_NEW_TOKENS), "--explain",
              "Why is the sky blue?")
    assert "policy" in out, out

    log("HTTP: GET /v1/models, POST /v1/chat/completions (whole and streamed)")
    models = json.loads(curl(f"{http_url}/v1/models"))
    model = models["data"][0]["id"]
    print(f"models: {[m['id'] for m in models['data']]}")
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": MAX_NEW_TOKENS}
    reply = json.loads(curl(f"{http_url}/v1/chat/completions", "-H", "Content-Type: application/json",
                            "-d", json.dumps(body)))
    print(f"chat completion: {reply['choices'][0]['message']['content']!r} usage={reply['usage']}")
    assert reply["usage"]["completion_tokens"] >= 1, reply
    stream = curl("-N", f"{http_url}/v1/chat/completions", "-H", "Content-Type: application/json",
                  "-d", json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}))
    events = [line.removeprefix("data: ") for line in stream.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", stream
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])
    print(f"streamed: {len(events) - 1} events, text {text!r}")


def burst(grpc_address: str, n: int) -> Counter:
    """n requests at once over gRPC; the workers that served them, as each stream's decision names them."""
    from tandem.client import RouterClient

    client = RouterClient(grpc_address)
    chosen: Counter = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            worker = ""
            request = client.request(f"Request {i}: write one sentence about the number {i}.",
                                     max_new_tokens=MAX_NEW_TOKENS)
            for response in client.generate(request, timeout=300):
                if response.HasField("decision"):
                    worker = response.decision.chosen_worker
            with lock:
                chosen[worker] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    log(f"burst of {n}: {time.monotonic() - started:.1f}s, decisions {dict(chosen)}")
    if errors:
        raise SystemExit(f"compose-test: {len(errors)} of {n} requests failed, first: {errors[0]!r}")
    return chosen


def scale_out(stack: Stack, grpc_address: str) -> None:
    from tandem.client import RouterClient, format_backends
    from tandem.v1 import common_pb2

    log(f"scaling cpu-worker to {SCALE}")
    stack("up", "-d", "--no-deps", "--no-build", "--scale", f"cpu-worker={SCALE}", "cpu-worker")
    stack.wait_healthy({"cpu-worker": SCALE})
    before = wait_router_backends(grpc_address, {"cpu": SCALE, "gpu": 1})
    routed_before = {b.name: b.routed_requests for b in before}
    chosen = burst(grpc_address, BURST)

    client = RouterClient(grpc_address)
    after = client.backends()
    client.close()
    print(format_backends(after))
    cli("backends", "--router", grpc_address)

    replicas = stack.addresses("cpu-worker")
    cpu = [b for b in after.backends if b.kind == common_pb2.WORKER_KIND_CPU]
    served = {}
    for b in cpu:
        delta = b.routed_requests - routed_before.get(b.name, 0)
        host = b.address.rsplit(":", 1)[0]
        served[b.name] = delta
        log(f"cpu backend {b.name} at {b.address} ({replicas.get(host, 'no replica at this address')}): "
            f"{delta} routed in the burst")
    assert sum(chosen.values()) == BURST
    if len(cpu) < SCALE or sum(1 for d in served.values() if d >= 1) < SCALE:
        raise SystemExit(f"compose-test: FAILED: {SCALE} cpu-worker replicas should each be routed >= 1 request; "
                         f"routed per cpu backend: {served}")
    known = {b.address.rsplit(":", 1)[0] for b in cpu} & set(replicas)
    log(f"OK: each of the {SCALE} cpu-worker replicas was routed requests ({served}); "
        f"{len(known)} of them matched to a container by address")


def main() -> int:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise SystemExit("compose-test: no Docker engine answers; deploy/compose/host-setup.sh sets one up")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        raise SystemExit("compose-test: `docker compose` (v2) is missing; deploy/compose/host-setup.sh installs it")

    base = base_image()
    log(f"base image: {base}")
    env = dict(os.environ, COMPOSE_PROFILES="cpu", TANDEM_BASE_IMAGE=base)
    if "TANDEM_TORCH_INDEX" not in os.environ:
        # The torch CPU wheel comes from wheels/ (filled here by this host's pip), so the build needs
        # no index besides PyPI: the same steps as the default build, without PyTorch's index.
        run([str(REPO / "deploy/compose/wheelhouse.sh")], env=dict(os.environ, TORCH_VARIANT="cpu"))
        env["TANDEM_TORCH_INDEX"] = "none"
    ca = host_ca_bundle()
    if ca is not None:
        (REPO / "certs").mkdir(exist_ok=True)
        shutil.copyfile(ca, REPO / "certs" / "host-ca.pem")
        log(f"build trusts this host's CA bundle {ca} (certs/host-ca.pem)")

    stack = Stack(env)
    build_started = time.monotonic()
    stack("build", "router")
    log(f"image tandem:latest built in {time.monotonic() - build_started:.0f}s")

    grpc_port, http_port = free_port(), free_port()
    env.update(TANDEM_GRPC_PUBLISH_PORT=str(grpc_port), TANDEM_HTTP_PUBLISH_PORT=str(http_port))
    grpc_address, http_url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    try:
        up_started = time.monotonic()
        stack("up", "-d", "--no-deps", "--no-build", "router", "cpu-worker", "gpu-worker-cpu")
        stack.wait_healthy({"router": 1, "cpu-worker": 1, "gpu-worker-cpu": 1})
        wait_router_backends(grpc_address, {"cpu": 1, "gpu": 1})
        log(f"stack up and healthy in {time.monotonic() - up_started:.0f}s; router on {grpc_address} and {http_url}")
        stack("ps")
        requests_through_the_ports(grpc_address, http_url)
        scale_out(stack, grpc_address)
        stack("logs", "--no-log-prefix", "--tail", "5", "router", check=False)
    except BaseException:
        stack("logs", "--tail", "60", check=False)
        raise
    finally:
        stack("down", "-v", "--remove-orphans", check=False)
    log(f"PASSED in {time.monotonic() - START:.0f}s")
    return 0


START = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
