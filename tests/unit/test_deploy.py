"""docker-compose.yml, the Dockerfile and their settings against the schema and against what the entry
points and the Dockerfile actually accept (no Docker needed; `make compose-test` runs the stack for real)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
TANDEM_SERVICES = {name: s for name, s in SERVICES.items() if s.get("command", [None])[:2] == ["python", "-m"]}
TEST_OVERRIDE = yaml.safe_load((REPO / "deploy" / "compose" / "test.override.yml").read_text())["services"]
ALLOWED_OTEL = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"}
DOCKERFILE = (REPO / "Dockerfile").read_text()
KIND = {"cpu_worker": "cpu", "gpu_worker": "gpu"}


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with every variable unset: its default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


def entry_point(service: dict):
    """(parser, parse_config) of the module a compose service runs."""
    module = service["command"][2]
    if module == "router_svc":
        from router_svc.config import build_parser, parse_config

        return build_parser(), parse_config
    from tandem.worker import config

    kind, port = {"cpu_worker": ("cpu", 50061), "gpu_worker": ("gpu", 50062)}[module]
    return config.build_parser(kind, port), lambda argv: config.parse_config(kind, port, argv)


def test_compose_file_matches_the_compose_spec():
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(REPO / "docker-compose.yml"),
         str(REPO / "deploy" / "compose" / "test.override.yml")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stack_has_every_service():
    assert {"router", "cpu-worker", "gpu-worker", "gpu-worker-cpu", "gpu-worker-vllm", "otel-collector", "jaeger",
            "prometheus", "grafana"} <= set(SERVICES)
    for name in ("gpu-worker", "gpu-worker-vllm"):
        reservation = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"], name
    assert SERVICES["gpu-worker-cpu"]["command"][-2:] == ["--device", "cpu"]
    assert "127.0.0.1:16686:16686" in SERVICES["jaeger"]["ports"]


def test_every_depends_on_target_exists():
    for name, service in SERVICES.items():
        for target in service.get("depends_on", {}):
            assert target in SERVICES, f"{name} depends on unknown service {target}"


def test_the_router_runs_without_the_observability_services():
    """`docker compose up --no-deps router ...` (make compose-test) and hosts without the tracing stack."""
    assert SERVICES["router"]["depends_on"]["otel-collector"]["required"] is False


@pytest.mark.parametrize("name", sorted(TANDEM_SERVICES))
def test_command_and_environment_are_accepted_by_the_entry_point(name, monkeypatch):
    service = TANDEM_SERVICES[name]
    parser, parse_config = entry_point(service)
    environment = {**service.get("environment", {}), **TEST_OVERRIDE.get(name, {}).get("environment", {})}
    unknown = {key for key in environment if key not in parser.env_vars and key not in ALLOWED_OTEL}
    assert not unknown, f"{name} sets variables its entry point ignores: {unknown}"
    for key in list(parser.env_vars) + sorted(ALLOWED_OTEL):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, interpolate(value))
    config = parse_config(service["command"][3:])
    assert config.port == int(environment["TANDEM_PORT"])
    assert config.host == "0.0.0.0"
    health_target = service["healthcheck"]["test"][-1]
    assert health_target == f"127.0.0.1:{config.port}", f"{name} healthcheck probes {health_target}"
    served = {config.port, getattr(config, "http_port", None)}
    for mapping in service.get("ports", []):
        assert int(mapping.split(":")[-1]) in served, f"{name} publishes {mapping}, which it does not serve"


def test_the_test_override_only_adjusts_services_of_the_stack():
    assert set(TEST_OVERRIDE) <= set(TANDEM_SERVICES)


def _names() -> set[str]:
    return set(SERVICES) | {alias for s in SERVICES.values()
                            for network in (s.get("networks") or {}).values() for alias in (network or {}).get("aliases", [])}


def test_router_workers_and_prometheus_targets_point_at_real_services():
    names = _names()
    ports = {name: int(s["environment"]["TANDEM_PORT"]) for name, s in TANDEM_SERVICES.items()}
    metrics = {name: int(s["environment"]["TANDEM_METRICS_PORT"]) for name, s in TANDEM_SERVICES.items()}
    kinds = {name: KIND.get(s["command"][2]) for name, s in TANDEM_SERVICES.items()}
    environment = SERVICES["router"]["environment"]
    assert "TANDEM_WORKERS" in environment or "TANDEM_DISCOVER" in environment
    for spec in filter(None, environment.get("TANDEM_WORKERS", "").split(",")):
        host, port = spec.split("@")[1].split(":")
        assert host in names and int(port) == ports[host], spec
    for spec in filter(None, environment.get("TANDEM_DISCOVER", "").split(",")):
        scheme, host, port, kind = spec.split(":")
        assert scheme == "dns" and host in names and int(port) == ports[host] and kind == kinds[host], spec
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job.get("static_configs", []) for t in c["targets"]]
    targets += [f"{name}:{c['port']}" for job in prometheus["scrape_configs"] for c in job.get("dns_sd_configs", [])
                for name in c["names"]]
    assert len(targets) == 3
    for target in targets:
        host, port = target.split(":")
        assert host in names and int(port) == metrics[host], target


def test_the_router_finds_every_worker_replica_by_dns():
    """`--scale cpu-worker=N` needs no router change: each replica's address is a worker of its own."""
    environment = SERVICES["router"]["environment"]
    assert "TANDEM_WORKERS" not in environment  # a static NAME@cpu-worker:PORT would reach one replica only
    names = {spec.split(":")[1] for spec in environment["TANDEM_DISCOVER"].split(",")}
    assert names == {"cpu-worker", "gpu-worker"}


def test_scaled_workers_are_scraped_by_dns():
    """Every replica of `--scale cpu-worker=N` is its own Prometheus target (one A record each)."""
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    for worker in ("cpu-worker", "gpu-worker"):
        (config,) = jobs[worker]["dns_sd_configs"]
        assert config["names"] == [worker] and config["type"] == "A"
    assert "container_name" not in SERVICES["cpu-worker"]  # a fixed name would forbid --scale


def test_only_the_router_is_published_and_by_default_on_loopback():
    published = {name: service.get("ports", []) for name, service in COMPOSE["services"].items() if service.get("ports")}
    assert [interpolate(p) for p in published["router"]] == ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"]
    assert all(p.startswith("${TANDEM_PUBLISH_HOST:-127.0.0.1}:") for p in published["router"])
    for name, ports in published.items():
        if name != "router":  # observability UIs: this host only
            assert all(port.startswith("127.0.0.1:") for port in ports), (name, ports)
    assert not any(name.startswith(("cpu-worker", "gpu-worker")) for name in published)


def _dockerfile_args() -> set[str]:
    return set(re.findall(r"^ARG ([A-Z_]+)", DOCKERFILE, re.M))


def test_three_images_from_one_dockerfile_with_the_cuda_builds_for_the_gpu_workers():
    images = {}
    for name, service in TANDEM_SERVICES.items():
        build = service["build"]
        assert build["context"] == "." and build.get("dockerfile", "Dockerfile") == "Dockerfile", name
        images[name] = (service["image"], build["args"]["TORCH_VARIANT"])
        assert set(build["args"]) <= _dockerfile_args(), f"{name} passes build args the Dockerfile lacks"
    assert images.pop("gpu-worker") == ("tandem-cuda:latest", "cuda")
    assert images.pop("gpu-worker-vllm") == ("tandem-vllm:latest", "cuda")
    assert set(images.values()) == {("tandem:latest", "cpu")}  # the router, cpu-worker and gpu-worker-cpu
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", DOCKERFILE, re.M)  # plain `docker build .` is the CPU image
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", DOCKERFILE, re.M)
    assert re.findall(r"^FROM (\S+)", DOCKERFILE, re.M) == ["${BASE_IMAGE}"] * 3


def test_the_vllm_image_installs_the_vllm_extra_and_its_worker_runs_the_vllm_engine():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    service = SERVICES["gpu-worker-vllm"]
    assert service["build"]["args"]["EXTRAS"] == "vllm" and any(d.startswith("vllm==") for d in extras["vllm"])
    assert re.search(r"^ARG EXTRAS=$", DOCKERFILE, re.M)  # no extra unless asked for
    assert service["environment"]["TANDEM_ENGINE"] == "vllm"
    assert "gpu-worker" in service["networks"]["default"]["aliases"]  # where the router and Prometheus look


def test_the_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore leaves out everything but the sources, wheels/ and certs/, and keeps what COPY needs."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    kept = {p[1:] for p in patterns if p.startswith("!")}
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, re.M):
        for source in line.split()[:-1]:
            assert source in kept, f"COPY {source}: left out of the build context by .dockerignore"
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    excluded = [p for p in patterns[1:] if not p.startswith("!")]
    assert any(fnmatch.fnmatch("tandem/v1", p) for p in excluded)  # generated in the image, never copied
    for folder in ("wheels", "certs"):
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{folder}/some-file"], cwd=REPO).returncode == 0
        assert ignored and (REPO / folder / "README.md").exists(), folder


def test_grafana_provisions_the_dashboard_from_the_repository():
    grafana = SERVICES["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])  # pinned
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    for volume in grafana["volumes"]:
        assert (REPO / volume.split(":")[0]).is_dir(), volume
    assert "prometheus" in grafana["depends_on"]
