"""Router settings: flags, TANDEM_* environment variables, and an optional TOML --config file.

Precedence: flag, then environment variable, then config file, then built-in default.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from router_svc.backends import WorkerAddress
from router_svc.policy import DEFAULT_POLICY, POLICIES
from tandem.options import EnvArgumentParser, port_number, positive_float

WORKERS_ENV = "TANDEM_WORKERS"

@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = DEFAULT_POLICY
    probe_deadline_ms: float = 50.0
    model: str | None = None
    metrics_port: int = 0
    workers: tuple[WorkerAddress, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if not self.workers:
            raise ValueError("at least one --worker NAME=KIND@HOST:PORT is required")


def build_parser(file_defaults: dict | None = None) -> EnvArgumentParser:
    defaults = file_defaults or {}
    parser = EnvArgumentParser(prog="python -m router_svc", description="Tandem router")
    parser.add_argument("--config", type=Path, help="TOML file with the same settings (keys as the flags, workers as a list)")
    parser.add_env_argument("--host", "TANDEM_HOST", defaults.get("host", "127.0.0.1"), help="address to listen on")
    parser.add_env_argument("--port", "TANDEM_PORT", defaults.get("port", 50051), type=port_number, help="gRPC port")
    parser.add_env_argument("--policy", "TANDEM_POLICY", defaults.get("policy", DEFAULT_POLICY), choices=list(POLICIES),
                            help="routing policy")
    parser.add_env_argument("--probe-deadline-ms", "TANDEM_PROBE_DEADLINE_MS", defaults.get("probe_deadline_ms", 50.0),
                            type=positive_float, help="deadline of the Estimate probe sent to every worker per request")
    parser.add_env_argument("--model", "TANDEM_MODEL", defaults.get("model"),
                            help="the model the workers serve, for its tokenizer (default: SmolLM2-135M-Instruct)")
    parser.add_env_argument("--metrics-port", "TANDEM_METRICS_PORT", defaults.get("metrics_port", 0), type=port_number,
                            help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--worker", action="append",
                        help="a worker as NAME=KIND@HOST:PORT (KIND cpu or gpu); repeat for more "
                             f"[env {WORKERS_ENV}, comma-separated]")
    parser.env_vars[WORKERS_ENV] = "worker"
    return parser


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    file_defaults = tomllib.loads(known.config.read_text()) if known.config else {}
    parser = build_parser(file_defaults)
    args = parser.parse_args(argv)
    specs = args.worker or _split(os.environ.get(WORKERS_ENV, "")) or list(file_defaults.get("workers", []))
    try:
        return RouterConfig(
            host=args.host,
            port=args.port,
            policy=args.policy,
            probe_deadline_ms=args.probe_deadline_ms,
            model=args.model,
            metrics_port=args.metrics_port,
            workers=tuple(WorkerAddress.parse(spec) for spec in specs),
        )
    except ValueError as exc:
        parser.error(str(exc))


def _split(value: str) -> list[str]:
    return [spec.strip() for spec in value.split(",") if spec.strip()]
