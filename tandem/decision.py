"""A routing decision: which worker a request went to, and how every worker scored.

The router makes it, clients read it. It is the one place that lists the parts of a worker's score;
the wire message (``tandem.protocol``), the router's JSON log line, its span attributes and the CLI
table are all made from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _part(column: str = "", number_format: str = "", default=0):
    """A score part, with its CLI column heading and number format (no heading: not a column)."""
    return field(default=default, metadata={"column": column, "format": number_format})


@dataclass(frozen=True)
class WorkerScore:
    """How one worker scored for one request. An ineligible worker has only ``reason`` and no parts."""

    worker: str
    kind: str
    eligible: bool
    reason: str = ""
    device: str = ""
    score_s: float = _part("score s", ".3f")
    cached_tokens: int = _part("cached", "d")
    pending_prefill_tokens: int = _part("prefill", "d")
    pending_decode_tokens: int = _part("decode", "d")
    inflight_requests: int = _part("inflight", "d")
    num_running: int = _part()
    num_waiting: int = _part()
    prefill_tokens_per_s: float = _part("prefill/s", ".0f")
    decode_tokens_per_s: float = _part("decode/s", ".0f")
    prefill_s: float = _part()
    decode_s: float = _part()
    state_source: str = _part("source", "", default="")


_FIELDS = tuple(f.name for f in fields(WorkerScore))
SCORE_PARTS = tuple(f.name for f in fields(WorkerScore) if "column" in f.metadata)
_COLUMNS = tuple((f.name, f.metadata["column"], f.metadata["format"]) for f in fields(WorkerScore)
                 if f.metadata.get("column"))


@dataclass(frozen=True)
class RoutingDecision:
    """The worker chosen for a request, every worker's score (lowest first, ineligible last), and the
    workers that failed before their first token."""

    policy: str
    chosen_worker: str
    prompt_tokens: int
    max_new_tokens: int
    scores: tuple[WorkerScore, ...]
    failed_workers: tuple[str, ...] = ()
    expected_new_tokens: int = 0
    length_key: str = ""
    moved_from: tuple[str, ...] = ()
    move_reason: str = ""

    @property
    def chosen(self) -> WorkerScore:
        return next(s for s in self.scores if s.worker == self.chosen_worker)

    def log_record(self, request_id: str) -> dict:
        """The decision as one JSON-ready log record."""
        return {
            "event": "route", "request_id": request_id, "policy": self.policy, "chosen": self.chosen_worker,
            "prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
            "expected_new_tokens": self.expected_new_tokens, "length_key": self.length_key,
            "failed_workers": list(self.failed_workers), "moved_from": list(self.moved_from),
            "move_reason": self.move_reason,
            "scores": [{name: getattr(s, name) for name in _FIELDS} for s in self.scores],
        }

    def span_attributes(self) -> dict:
        """The decision as span attributes: the choice, and every worker's score and its parts."""
        attributes = {
            "tandem.routing.policy": self.policy,
            "tandem.routing.chosen_worker": self.chosen_worker,
            "tandem.routing.cached_tokens": self.chosen.cached_tokens,
            "tandem.routing.failed_workers": list(self.failed_workers),
            "tandem.routing.expected_new_tokens": self.expected_new_tokens,
            "tandem.routing.length_key": self.length_key,
            "tandem.routing.moved_from": list(self.moved_from),
            "tandem.routing.move_reason": self.move_reason,
        }
        for s in self.scores:
            prefix = f"tandem.routing.worker.{s.worker}"
            attributes[f"{prefix}.eligible"] = s.eligible
            if s.eligible:
                attributes.update({f"{prefix}.{part}": getattr(s, part) for part in SCORE_PARTS})
            else:
                attributes[f"{prefix}.reason"] = s.reason
        return attributes

    def table(self) -> str:
        """The decision as a text table: one row per worker, the chosen one marked."""
        failed = f" (after failures: {', '.join(self.failed_workers)})" if self.failed_workers else ""
        if self.moved_from:
            failed += f" (moved from {', '.join(self.moved_from)}: {self.move_reason})"
        widths = [max(len(heading) + 2, 9) for _, heading, _ in _COLUMNS]
        lines = [
            f"policy {self.policy}: {self.prompt_tokens} prompt tokens, {self.max_new_tokens} new "
            f"({self.expected_new_tokens} expected{f' for {self.length_key!r}' if self.length_key else ''}) "
            f"-> {self.chosen_worker}{failed}",
            f"  {'worker':<10}" + "".join(f"{heading:>{w}}" for (_, heading, _), w in zip(_COLUMNS, widths)),
        ]
        for s in self.scores:
            mark = "*" if s.worker == self.chosen_worker else " "
            if not s.eligible:
                lines.append(f"{mark} {s.worker:<10}  not eligible: {s.reason}")
                continue
            lines.append(f"{mark} {s.worker:<10}" + "".join(
                f"{format(getattr(s, name), number_format):>{w}}" for (name, _, number_format), w in zip(_COLUMNS, widths)
            ))
        return "\n".join(lines)
