"""Conversions between tandem.v1 messages and the library's own types, shared by the router and the workers."""

from __future__ import annotations

from tandem.engine.errors import InvalidRequestError
from tandem.engine.request import SamplingParams
from tandem.v1 import common_pb2

WORKER_KINDS = {"cpu": common_pb2.WORKER_KIND_CPU, "gpu": common_pb2.WORKER_KIND_GPU}
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
