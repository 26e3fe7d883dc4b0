"""Conversions between tandem.v1 messages and the library's own types, shared by the router and the workers."""

from __future__ import annotations

from dataclasses import fields

from tandem.decision import RoutingDecision, WorkerScore
from tandem.engine.errors import InvalidRequestError
from tandem.engine.request import SamplingParams
from tandem.v1 import common_pb2, router_pb2

WORKER_KINDS = {"cpu": common_pb2.WORKER_KIND_CPU, "gpu": common_pb2.WORKER_KIND_GPU}
_KIND_NAMES = {number: name for name, number in WORKER_KINDS.items()}
_SCORE_FIELDS = tuple(f.name for f in fields(WorkerScore) if f.name != "kind")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """Validated sampling settings; unset fields keep their defaults.

    Raises:
        InvalidRequestError: with the field named as the API spells it, e.g. ``sampling.top_p``.
    """
    given = {name: getattr(message, name) for name in _SAMPLING_FIELDS if message.HasField(name)}
    try:
        return SamplingParams(**given)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", exc.reason) from None


def decision_message(decision: RoutingDecision) -> router_pb2.RoutingDecision:
    return router_pb2.RoutingDecision(
        policy=decision.policy, chosen_worker=decision.chosen_worker, prompt_tokens=decision.prompt_tokens,
        max_new_tokens=decision.max_new_tokens, failed_workers=decision.failed_workers,
        scores=[router_pb2.WorkerScore(kind=WORKER_KINDS[s.kind], **{name: getattr(s, name) for name in _SCORE_FIELDS})
                for s in decision.scores],
    )


def decision_from_message(message: router_pb2.RoutingDecision) -> RoutingDecision:
    return RoutingDecision(
        policy=message.policy, chosen_worker=message.chosen_worker, prompt_tokens=message.prompt_tokens,
        max_new_tokens=message.max_new_tokens, failed_workers=tuple(message.failed_workers),
        scores=tuple(WorkerScore(kind=_KIND_NAMES.get(s.kind, ""), **{name: getattr(s, name) for name in _SCORE_FIELDS})
                     for s in message.scores),
    )
