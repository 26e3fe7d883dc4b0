"""Router settings: flags, TANDEM_* environment variables, and an optional TOML --config file.

Precedence: flag, then environment variable, then config file, then built-in default.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from router_svc import discovery
from router_svc.policies import DEFAULT_POLICY, POLICIES
from router_svc.replacement import CHECK_INTERVAL_S
from router_svc.workers import KEEPALIVE_S, WorkerAddress
from tandem.options import (
    EnvArgumentParser,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from tandem.security import ClientTLS, ServerTLS, add_server_tls_arguments, client_tls, server_tls
from tandem.serving import MIN_KEEPALIVE_S

WORKERS_ENV = "TANDEM_WORKERS"
DISCOVER_ENV = "TANDEM_DISCOVER"
SERVED_NAMES_ENV = "TANDEM_SERVED_MODEL_NAME"

@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = DEFAULT_POLICY
    probe_deadline_ms: float = 50.0
    replace_interval_s: float = CHECK_INTERVAL_S
    model: str | None = None
    metrics_port: int = 0
    workers: tuple[WorkerAddress, ...] = field(default_factory=tuple)
    tls: ServerTLS | None = None
    auth_tokens: tuple[str, ...] = ()
    worker_tls: ClientTLS | None = None
    worker_keepalive_s: float = KEEPALIVE_S
    max_inflight: int = 512
    max_queued: int = 512
    queue_timeout_s: float = 30.0
    max_message_bytes: int = 4 << 20
    http_port: int = 8000
    served_model_names: tuple[str, ...] = ()
    discover: tuple[str, ...] = ()
    discovery: discovery.DiscoverySettings = field(default_factory=discovery.DiscoverySettings)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.worker_keepalive_s < MIN_KEEPALIVE_S:
            raise ValueError(f"worker_keepalive_s must be at least {MIN_KEEPALIVE_S} (the workers' quickest "
                             f"keepalive); got {self.worker_keepalive_s}")
        if not self.workers and not self.discover:
            raise ValueError("at least one --worker NAME=KIND@HOST:PORT or --discover is required")


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
    parser.add_env_argument("--replace-interval-s", "TANDEM_REPLACE_INTERVAL_S",
                            defaults.get("replace_interval_s", CHECK_INTERVAL_S), type=non_negative_float,
                            help="how often a request routed by finish_time that still waits on its worker is checked "
                                 "for a move to a worker that would finish it clearly earlier (0: never moved)")
    parser.add_env_argument("--model", "TANDEM_MODEL", defaults.get("model"),
                            help="the model the workers serve, for its tokenizer (default: SmolLM2-135M-Instruct)")
    parser.add_env_argument("--http-port", "TANDEM_HTTP_PORT", defaults.get("http_port", 8000), type=port_number,
                            help="serve the OpenAI-compatible HTTP API on this port (0: off)")
    parser.add_env_list_argument("--served-model-name", SERVED_NAMES_ENV,
                                 "a name requests may give the model by over HTTP, besides its own; repeatable")
    parser.add_env_argument("--metrics-port", "TANDEM_METRICS_PORT", defaults.get("metrics_port", 0), type=port_number,
                            help="serve Prometheus metrics on this port (0: off)")
    parser.add_env_list_argument("--worker", WORKERS_ENV,
                                 "a worker as NAME=KIND@HOST:PORT (KIND cpu or gpu); repeat for more")
    parser.add_env_list_argument("--discover", DISCOVER_ENV,
                                 "find workers while running: dns:NAME:PORT:KIND (every address of NAME, re-resolved) "
                                 "or k8s (pods matching --selector); repeatable")
    parser.add_env_argument("--discover-interval-s", "TANDEM_DISCOVER_INTERVAL_S", defaults.get("discover_interval_s", 1.0),
                            type=positive_float, help="seconds between DNS lookups; first retry delay after a failure")
    parser.add_env_argument("--dns-server", "TANDEM_DNS_SERVER", defaults.get("dns_server"),
                            help="HOST[:PORT] of the DNS server to ask (default: the system's resolver configuration)")
    parser.add_env_argument("--namespace", "TANDEM_NAMESPACE", defaults.get("namespace"),
                            help="namespace of the worker pods (default: the router's own, or default)")
    parser.add_env_argument("--selector", "TANDEM_SELECTOR", defaults.get("selector", discovery.DEFAULT_SELECTOR),
                            help="label selector of the worker pods")
    parser.add_env_argument("--kind-label", "TANDEM_KIND_LABEL", defaults.get("kind_label", discovery.DEFAULT_KIND_LABEL),
                            help="pod label whose value (cpu or gpu) is the worker's kind")
    parser.add_env_argument("--port-name", "TANDEM_PORT_NAME", defaults.get("port_name", discovery.DEFAULT_PORT_NAME),
                            help="name of the worker container's gRPC port")
    parser.add_env_argument("--max-inflight", "TANDEM_MAX_INFLIGHT", defaults.get("max_inflight", 512),
                            type=positive_int, help="requests the router runs at once; more wait in its queue")
    parser.add_env_argument("--max-queued", "TANDEM_MAX_QUEUED", defaults.get("max_queued", 512), type=non_negative_int,
                            help="requests that may wait for a slot; beyond it RESOURCE_EXHAUSTED at once")
    parser.add_env_argument("--queue-timeout-s", "TANDEM_QUEUE_TIMEOUT_S", defaults.get("queue_timeout_s", 30.0),
                            type=positive_float, help="longest wait for a slot before RESOURCE_EXHAUSTED")
    parser.add_env_argument("--max-message-bytes", "TANDEM_MAX_MESSAGE_BYTES", defaults.get("max_message_bytes", 4 << 20),
                            type=positive_int, help="largest request message accepted; larger ones get RESOURCE_EXHAUSTED")
    parser.add_env_argument("--worker-keepalive-s", "TANDEM_WORKER_KEEPALIVE_S",
                            defaults.get("worker_keepalive_s", KEEPALIVE_S), type=positive_float,
                            help="seconds a worker's connection may stay silent before the router pings it; a worker "
                                 "that answers no ping within as long again (a frozen host, a cut network) is lost: "
                                 "its calls fail and fail over as a crashed worker's do")
    add_server_tls_arguments(parser, defaults)
    parser.add_env_argument("--auth-token-file", "TANDEM_AUTH_TOKEN_FILE", defaults.get("auth_token_file"),
                            help="file of bearer tokens, one per line: clients must send one (health stays open)")
    parser.add_env_argument("--worker-ca", "TANDEM_WORKER_CA", defaults.get("worker_ca"),
                            help="PEM CA that signed the workers' certificates: talk TLS to the workers")
    parser.add_env_argument("--worker-cert", "TANDEM_WORKER_CERT", defaults.get("worker_cert"),
                            help="PEM client certificate for the workers (mTLS, with --worker-key)")
    parser.add_env_argument("--worker-key", "TANDEM_WORKER_KEY", defaults.get("worker_key"),
                            help="PEM private key of --worker-cert")
    return parser


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    file_defaults = tomllib.loads(known.config.read_text()) if known.config else {}
    parser = build_parser(file_defaults)
    args = parser.parse_args(argv)
    specs = args.worker or _split(os.environ.get(WORKERS_ENV, "")) or list(file_defaults.get("workers", []))
    discover = args.discover or _split(os.environ.get(DISCOVER_ENV, "")) or list(file_defaults.get("discover", []))
    try:
        return RouterConfig(
            host=args.host,
            port=args.port,
            policy=args.policy,
            probe_deadline_ms=args.probe_deadline_ms,
            replace_interval_s=args.replace_interval_s,
            model=args.model,
            metrics_port=args.metrics_port,
            workers=tuple(WorkerAddress.parse(spec) for spec in specs),
            discover=tuple(dict.fromkeys(discovery.parse_spec(spec) for spec in discover)),
            discovery=discovery.DiscoverySettings(args.discover_interval_s, args.dns_server, args.namespace,
                                                  args.selector, args.kind_label, args.port_name),
            max_inflight=args.max_inflight,
            max_queued=args.max_queued,
            queue_timeout_s=args.queue_timeout_s,
            max_message_bytes=args.max_message_bytes,
            http_port=args.http_port,
            served_model_names=tuple(args.served_model_name or _split(os.environ.get(SERVED_NAMES_ENV, ""))
                                     or file_defaults.get("served_model_names", [])),
            tls=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
            auth_tokens=read_tokens(args.auth_token_file) if args.auth_token_file else (),
            worker_tls=client_tls(args.worker_ca, args.worker_cert, args.worker_key),
            worker_keepalive_s=args.worker_keepalive_s,
        )
    except ValueError as exc:
        parser.error(str(exc))


def read_tokens(path: str) -> tuple[str, ...]:
    """Bearer tokens from ``path``: one per line; blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--auth-token-file: {exc}") from None
    tokens = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise ValueError(f"--auth-token-file: {path} holds no token")
    return tokens


def _split(value: str) -> list[str]:
    return [spec.strip() for spec in value.split(",") if spec.strip()]
