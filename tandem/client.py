"""A small Python client for the Tandem router."""

from __future__ import annotations

import os
from collections.abc import Iterator

from tandem.protocol import decision_from_message
from tandem.security import ClientTLS, bearer_metadata, channel
from tandem.telemetry import outgoing_metadata
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_ROUTER = os.environ.get("TANDEM_ROUTER", "127.0.0.1:50051")


class RouterClient:
    """Calls a router at ``address`` (host:port), over TLS with ``tls``, sending ``token`` as a bearer token."""

    def __init__(self, address: str = DEFAULT_ROUTER, tls: ClientTLS | None = None, token: str | None = None):
        self.channel = channel(address, tls)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.token = token

    def _metadata(self, span) -> tuple[tuple[str, str], ...]:
        return (*(outgoing_metadata(span) if span else ()), *bearer_metadata(self.token))

    @staticmethod
    def request(prompt: str, chat: bool = True, max_new_tokens: int = 128, temperature: float = 0.0,
                policy: str = "", **fields) -> router_pb2.RouteRequest:
        """A RouteRequest for ``prompt``: a single user chat message, or plain text when ``chat`` is False."""
        message = router_pb2.RouteRequest(max_new_tokens=max_new_tokens, policy=policy,
                                          sampling=common_pb2.SamplingParams(temperature=temperature), **fields)
        if chat:
            message.chat.messages.add(role="user", content=prompt)
        else:
            message.prompt_text = prompt
        return message

    def generate(self, request: router_pb2.RouteRequest, timeout: float | None = None,
                 span=None) -> Iterator[router_pb2.RouteResponse]:
        """Stream a generation; with ``span``, its trace context travels along (W3C traceparent)."""
        return self.stub.Generate(request, timeout=timeout, metadata=self._metadata(span))

    def explain(self, request: router_pb2.RouteRequest, timeout: float = 10.0, span=None) -> router_pb2.RoutingDecision:
        return self.stub.Explain(router_pb2.ExplainRequest(request=request), timeout=timeout,
                                 metadata=self._metadata(span)).decision

    def backends(self, timeout: float = 10.0) -> router_pb2.ListBackendsResponse:
        return self.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=timeout, metadata=self._metadata(None))

    def close(self) -> None:
        self.channel.close()


def format_decision(decision: router_pb2.RoutingDecision) -> str:
    """The decision as a table: one row per worker, the chosen one marked."""
    return decision_from_message(decision).table()


def format_backends(listing: router_pb2.ListBackendsResponse) -> str:
    """The workers' states, one row each, then the learned output lengths."""
    backends = listing.backends
    width = max([10, *(len(b.name) + 2 for b in backends)])
    header = (f"{'worker':<{width}}{'kind':<6}{'address':<22}{'device':<8}{'status':<12}{'run':>5}{'wait':>5}"
              f"{'prefill':>9}{'decode':>8}{'prefill/s':>11}{'decode/s':>10}{'routed':>8}{'inflight':>9}")
    lines = [header]
    for b in backends:
        state = b.state
        kind = common_pb2.WorkerKind.Name(b.kind).removeprefix("WORKER_KIND_").lower()
        lines.append(
            f"{b.name:<{width}}{kind:<6}{b.address:<22}{b.device or '-':<8}{b.status[:11]:<12}{state.num_running:>5}"
            f"{state.num_waiting:>5}{state.pending_prefill_tokens:>9}{state.pending_decode_tokens:>8}"
            f"{state.rates.prefill_tokens_per_s:>11.0f}{state.rates.decode_tokens_per_s:>10.0f}"
            f"{b.routed_requests:>8}{b.inflight_requests:>9}"
        )
    lines.append("output used of max_new_tokens, learned: " + ", ".join(
        f"{learned.key or 'all requests'} {learned.fraction:.0%} ({learned.samples} requests)"
        for learned in listing.output_lengths))
    return "\n".join(lines)
