"""A worker's facts in one shape, from its report to the policies.

``WorkerReport`` is what a worker reports (``from_state`` reads it off the wire, the simulator builds it
from its scheduler). ``WorkerView`` is that report as a policy scores it for one request: the report
itself, the prompt's hit in the worker's prefix cache, and the requests the router sent the worker that
the report does not show yet. Everything a policy or a decision needs beyond the report is derived here,
once. Plain Python: no grpc, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property


def reported_block_size(state) -> int:
    """The KV block size a ``BackendState`` reports (16 where a worker leaves it unset)."""
    return state.block_size or 16


@dataclass(frozen=True)
class QueuedWork:
    """One request's remaining work on a worker: as reported, or ``credited`` by the router (dispatched, and
    not in the worker's report yet). ``cached_tokens``: for a waiting request, the prompt tokens it counts
    on the prefix cache for."""

    running: bool
    prefill_tokens: int
    decode_tokens: int
    credited: bool = False
    request_id: str = ""
    cached_tokens: int = 0
    constrained: bool = False  # it has a structured output, whose mask each of its steps pays


@dataclass(frozen=True)
class Credit:
    """A request the router sent to a worker, counted until the worker's reports show it."""

    request_id: str
    prefill_tokens: int
    decode_tokens: int
    constrained: bool = False


@dataclass(frozen=True)
class WorkerReport:
    """A worker's own report: every request it holds, its limits, its step-time model and its KV cache.

    ``step_*`` and ``small_step_*`` are the fitted step-time model (``tandem.step_time``), plus
    per_constrained_row * requests with a structured output. ``kv_blocks_*`` count blocks of ``block_size``
    tokens (total 0: unknown, and the policies ignore KV capacity).
    """

    name: str
    kind: str
    max_active_requests: int
    prefill_tok_s: float
    decode_tok_s: float
    device: str = ""
    requests: tuple[QueuedWork, ...] = ()
    max_num_batched_tokens: int = 512
    max_prefill_step_tokens: int = 0  # never below max_num_batched_tokens (tandem.step_time.step_budget)
    step_base_s: float = 0.0
    step_per_prefill_token_s: float = 0.0
    step_per_decode_s: float = 0.0
    step_per_constrained_row_s: float = 0.0
    small_step_rows: int = 0
    small_step_base_s: float = 0.0
    small_step_per_row_s: float = 0.0
    block_size: int = 16
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0

    @classmethod
    def from_state(cls, name: str, kind: str, state, info) -> "WorkerReport":
        """The report in a ``BackendState`` message, with the step budgets of the worker's ``GetInfoResponse``."""
        rates = state.rates
        return cls(
            name=name, kind=kind, device=state.device,
            requests=tuple(QueuedWork(r.running, r.prefill_tokens, r.decode_tokens, request_id=r.request_id,
                                      cached_tokens=r.cached_tokens, constrained=r.constrained)
                           for r in state.requests),
            max_active_requests=state.max_active_requests, max_num_batched_tokens=info.max_num_batched_tokens,
            max_prefill_step_tokens=info.max_prefill_step_tokens,
            prefill_tok_s=rates.prefill_tokens_per_s, decode_tok_s=rates.decode_tokens_per_s,
            step_base_s=rates.step_base_s, step_per_prefill_token_s=rates.step_per_prefill_token_s,
            step_per_decode_s=rates.step_per_decode_s, step_per_constrained_row_s=rates.step_per_constrained_row_s,
            small_step_rows=rates.small_step_rows, small_step_base_s=rates.small_step_base_s,
            small_step_per_row_s=rates.small_step_per_row_s,
            block_size=reported_block_size(state),
            kv_blocks_total=state.kv_blocks_total, kv_blocks_used=state.kv_blocks_used,
            kv_blocks_cached=state.kv_blocks_cached,
        )


@dataclass(frozen=True)
class WorkerView:
    """One worker as a policy scores it for one request.

    ``cached_tokens``: the prompt's tokens in the worker's prefix cache (0 when unknown); of those,
    ``cached_evictable_tokens`` sit in blocks no request holds. ``credited``: the requests the router sent
    and the report does not show yet. ``state_source``: "index" for the latest report with the prompt looked
    up in the router's copy of the worker's prefix index, "estimate" for a report made for this prompt,
    "snapshot" for the latest report alone.
    """

    report: WorkerReport
    cached_tokens: int = 0
    cached_evictable_tokens: int = 0
    credited: tuple[QueuedWork, ...] = ()
    state_source: str = "estimate"

    @classmethod
    def of(cls, report: WorkerReport, cached_tokens: int = 0, credits: Iterable[Credit] = (),
           state_source: str = "estimate", cached_evictable_tokens: int = 0) -> "WorkerView":
        """The view of ``report`` with the router's ``credits`` that the report does not show yet."""
        visible = {work.request_id for work in report.requests}
        credited = tuple(QueuedWork(False, c.prefill_tokens, c.decode_tokens, credited=True, request_id=c.request_id,
                                    constrained=c.constrained) for c in credits if c.request_id not in visible)
        return cls(report, cached_tokens, cached_evictable_tokens, credited, state_source)

    @property
    def name(self) -> str:
        return self.report.name

    @property
    def kind(self) -> str:
        return self.report.kind

    @cached_property
    def queue(self) -> tuple[QueuedWork, ...]:
        """Every request on the worker, in its queue order, then the credited ones."""
        return self.report.requests + self.credited

    @cached_property
    def num_running(self) -> int:
        return sum(1 for work in self.queue if work.running)

    @cached_property
    def num_waiting(self) -> int:
        return len(self.queue) - self.num_running

    @cached_property
    def pending_prefill_tokens(self) -> int:
        return sum(work.prefill_tokens for work in self.queue)

    @cached_property
    def pending_decode_tokens(self) -> int:
        return sum(work.decode_tokens for work in self.queue)

    @property
    def inflight_requests(self) -> int:
        return len(self.credited)

    def score_parts(self) -> dict:
        """The parts of a decision's ``WorkerScore`` that describe the worker rather than the score."""
        return dict(device=self.report.device, cached_tokens=self.cached_tokens,
                    pending_prefill_tokens=self.pending_prefill_tokens,
                    pending_decode_tokens=self.pending_decode_tokens, inflight_requests=self.inflight_requests,
                    num_running=self.num_running, num_waiting=self.num_waiting,
                    prefill_tokens_per_s=self.report.prefill_tok_s, decode_tokens_per_s=self.report.decode_tok_s,
                    state_source=self.state_source)
