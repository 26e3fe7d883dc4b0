"""Prometheus metrics of the router's decisions."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUTING_DECISIONS = Counter(
    "tandem_router_decisions_total", "Routing decisions, by chosen worker, its kind, and policy", ["worker", "kind", "policy"]
)
ROUTING_FAILOVERS = Counter(
    "tandem_router_failovers_total", "Requests moved to another worker after a failure before the first token", ["worker"]
)
ROUTING_MOVES = Counter(
    "tandem_router_moves_total", "Requests withdrawn from a worker before their first token and routed again, by the "
    "worker left, the worker chosen by the move's estimate, and cause (estimate_grew, earlier_elsewhere)",
    ["from_worker", "to_worker", "cause"]
)
WORKER_SCORE = Histogram(
    "tandem_router_worker_score_seconds", "Each eligible worker's score at decision time (cost and finish_time policies)",
    ["worker", "policy"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
)

OUTPUT_FRACTION = Gauge("tandem_router_output_fraction",
                        "Learned share of max_new_tokens that requests generate, by length_key (empty: all requests)",
                        ["length_key"])
OUTPUT_FRACTION_SAMPLES = Gauge("tandem_router_output_fraction_samples",
                                "Finished requests each learned output share comes from, by length_key", ["length_key"])


def set_output_fraction(key: str, fraction: float | None, samples: int) -> None:
    """Publish one key's learned output share (``router_svc.output_lengths``); None: the key was forgotten."""
    if fraction is None:
        OUTPUT_FRACTION.remove(key)
        OUTPUT_FRACTION_SAMPLES.remove(key)
        return
    OUTPUT_FRACTION.labels(key).set(fraction)
    OUTPUT_FRACTION_SAMPLES.labels(key).set(samples)


RPCS = Counter("tandem_router_rpcs_total", "RPCs by method and final gRPC status code (errors included)",
               ["method", "code"])
TTFT = Histogram("tandem_router_time_to_first_token_seconds", "Time from the request to its first token, through the router",
                 ["frontend"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40))
E2E = Histogram("tandem_router_request_duration_seconds", "Time from the request to its last token, through the router",
                ["frontend"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160))


HTTP_REQUESTS = Counter("tandem_router_http_requests_total", "HTTP requests by route and final HTTP status",
                        ["route", "status"])


WORKERS = Gauge("tandem_router_workers", "Workers in the routing pool (leaving ones not counted), by kind", ["kind"])
MEMBERSHIP_CHANGES = Counter("tandem_router_membership_changes_total",
                             "Workers that joined or left the pool, by source (static or a discovery) and change",
                             ["source", "change"])
WORKERS_REFUSED = Counter("tandem_router_workers_refused_total",
                          "Workers not routed to, or pods not admitted, by source and reason", ["source", "reason"])
DISCOVERY_UP = Gauge("tandem_router_discovery_up", "1 while a discovery's last lookup succeeded, else 0", ["source"])
DISCOVERY_ERRORS = Counter("tandem_router_discovery_errors_total", "Failed discovery lookups (DNS queries, API calls)",
                           ["source"])


def rpc_status_recorder(method: str):
    return lambda code: RPCS.labels(method, code.name).inc()


def record_decision(message) -> None:
    """Count a decision (a tandem.v1.RoutingDecision) and observe every eligible worker's score."""
    ROUTING_DECISIONS.labels(message.chosen_worker, message.chosen.kind, message.policy).inc()
    if message.policy in ("cost", "finish_time"):
        for score in message.scores:
            if score.eligible:
                WORKER_SCORE.labels(score.worker, message.policy).observe(score.score_s)
