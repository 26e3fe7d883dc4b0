"""docker-compose.yml against the schema and against what the entry points actually accept (no Docker here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
TANDEM_SERVICES = {name: s for name, s in SERVICES.items() if s.get("command", [None])[:2] == ["python", "-m"]}
ALLOWED_OTEL = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"}


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
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(REPO / "docker-compose.yml")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_stack_has_every_service():
    assert {"router", "cpu-worker", "gpu-worker", "gpu-worker-cpu", "otel-collector", "jaeger", "prometheus"} <= set(SERVICES)
    reservation = SERVICES["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"]
    assert SERVICES["gpu-worker-cpu"]["command"][-2:] == ["--device", "cpu"]
    assert "127.0.0.1:16686:16686" in SERVICES["jaeger"]["ports"]


def test_every_depends_on_target_exists():
    for name, service in SERVICES.items():
        for target in service.get("depends_on", {}):
            assert target in SERVICES, f"{name} depends on unknown service {target}"


@pytest.mark.parametrize("name", sorted(TANDEM_SERVICES))
def test_command_and_environment_are_accepted_by_the_entry_point(name, monkeypatch):
    service = TANDEM_SERVICES[name]
    parser, parse_config = entry_point(service)
    environment = service.get("environment", {})
    unknown = {key for key in environment if key not in parser.env_vars and key not in ALLOWED_OTEL}
    assert not unknown, f"{name} sets variables its entry point ignores: {unknown}"
    for key in list(parser.env_vars) + sorted(ALLOWED_OTEL):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, str(value))
    config = parse_config(service["command"][3:])
    assert config.port == int(environment["TANDEM_PORT"])
    assert config.host == "0.0.0.0"
    health_target = service["healthcheck"]["test"][-1]
    assert health_target == f"127.0.0.1:{config.port}", f"{name} healthcheck probes {health_target}"
    served = {config.port, getattr(config, "http_port", None)}
    for mapping in service.get("ports", []):
        assert int(mapping.split(":")[-1]) in served, f"{name} publishes {mapping}, which it does not serve"


def test_router_workers_and_prometheus_targets_point_at_real_services():
    names = set(SERVICES) | {alias for s in SERVICES.values()
                             for network in (s.get("networks") or {}).values() for alias in (network or {}).get("aliases", [])}
    ports = {name: int(s["environment"]["TANDEM_PORT"]) for name, s in TANDEM_SERVICES.items()}
    metrics = {name: int(s["environment"]["TANDEM_METRICS_PORT"]) for name, s in TANDEM_SERVICES.items()}
    for spec in SERVICES["router"]["environment"]["TANDEM_WORKERS"].split(","):
        host, port = spec.split("@")[1].split(":")
        assert host in names and int(port) == ports[host], spec
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert len(targets) == 3
    for target in targets:
        host, port = target.split(":")
        assert host in names and int(port) == metrics[host], target


def test_only_the_router_is_published_and_by_default_on_loopback():
    published = {name: service.get("ports", []) for name, service in COMPOSE["services"].items() if service.get("ports")}
    assert published["router"] == ["${TANDEM_PUBLISH_HOST:-127.0.0.1}:50051:50051",
                                   "${TANDEM_PUBLISH_HOST:-127.0.0.1}:8000:8000"]
    for name, ports in published.items():
        if name != "router":  # observability UIs: this host only
            assert all(port.startswith("127.0.0.1:") for port in ports), (name, ports)
    assert not any(name.startswith(("cpu-worker", "gpu-worker")) for name in published)
