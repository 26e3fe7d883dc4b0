"""One preparation of a request for every front end: what a front end parsed becomes the routed request.

Both front ends parse their own wire format into a ``Submission`` and call ``Preparation.prepare``, so
the policy, the length key, the token ids against the vocabulary, the context length and the sampling
settings are checked once, in one order, with one message each. An error names the field as the router's
gRPC API spells it; the HTTP front end renames it to the OpenAI spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from router_svc.output_lengths import check_length_key
from router_svc.policies import POLICIES
from router_svc.request_path import RoutedRequest
from tandem.errors import ContextLengthExceeded, InvalidRequestError
from tandem.protocol import checked_sampling_params
from tandem.sampling import check_samples
from tandem.v1 import common_pb2, worker_pb2


@dataclass(frozen=True)
class Submission:
    """A request as a front end parsed it, in the router's terms.

    ``max_new_tokens`` None asks for as many tokens as the context leaves. ``prompt_field`` is how the
    request gave its prompt (``prompt_token_ids``, ``prompt_text`` or ``chat.messages``), for errors.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int | None
    frontend: str
    prompt_field: str = "prompt_token_ids"
    policy: str = ""
    length_key: str = ""
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_string: bool = False
    keep_special_tokens: bool = False
    deadline: float | None = None
    n: int = 1


class Preparation:
    """Checks submissions against the served model and makes the worker's request.

    Args:
        default_policy: the policy of a submission that names none.
        model_limits: (tokens a request may span, vocabulary size) as the workers report them; None before
            any worker has reported, when only what needs no model is checked (routing then says no
            worker is ready).
    """

    def __init__(self, default_policy: str, model_limits: Callable[[], tuple[int, int] | None]):
        self.default_policy = default_policy
        self.model_limits = model_limits

    async def prepare(self, submission: Submission) -> RoutedRequest:
        """Raises:
            InvalidRequestError: a field is invalid; the error names it.
        """
        policy = submission.policy or self.default_policy
        if policy not in POLICIES:
            raise InvalidRequestError("policy", f"must be one of {', '.join(POLICIES)}; got {policy!r}")
        check_length_key("length_key", submission.length_key)
        if submission.max_new_tokens is not None and submission.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {submission.max_new_tokens}")
        sampling = await checked_sampling_params(submission.sampling)
        n = check_samples(submission.n)
        limits = self.model_limits()
        max_new_tokens = self._budget(submission, limits)
        if sampling.min_tokens > max_new_tokens:
            raise InvalidRequestError("sampling.min_tokens", f"must be at most the output budget ({max_new_tokens} "
                                                             f"tokens), got {sampling.min_tokens}")
        _check_vocabulary("sampling.logit_bias", sampling.logit_bias, limits)
        _check_vocabulary("sampling.allowed_token_ids", sampling.allowed_token_ids, limits)
        worker_request = worker_pb2.GenerateRequest(
            request_id=submission.request_id, prompt_token_ids=worker_pb2.TokenIds(ids=submission.prompt_token_ids),
            max_new_tokens=max_new_tokens, sampling=submission.sampling, stop=submission.stop,
            stop_token_ids=submission.stop_token_ids, ignore_eos=submission.ignore_eos,
            include_stop_string=submission.include_stop_string, keep_special_tokens=submission.keep_special_tokens,
            n=n,
        )
        return RoutedRequest(submission.request_id, submission.prompt_token_ids, max_new_tokens, policy, worker_request,
                             submission.deadline, submission.frontend, submission.length_key)

    @staticmethod
    def _budget(submission: Submission, limits: tuple[int, int] | None) -> int:
        """The request's output budget, checked against the served model's vocabulary and context."""
        if limits is None:
            return submission.max_new_tokens or 1
        context_length, _ = limits  # the context, or the largest KV cache where that is less
        prompt, requested = submission.prompt_token_ids, submission.max_new_tokens
        _check_vocabulary(submission.prompt_field, prompt, limits)
        if requested is not None and len(prompt) + requested > context_length:
            raise ContextLengthExceeded("max_new_tokens", f"this model's context is {context_length} tokens; the "
                                                          f"prompt has {len(prompt)} and the output asks for {requested}")
        if len(prompt) >= context_length:
            raise ContextLengthExceeded(submission.prompt_field,
                                        f"this model's context is {context_length} tokens; the prompt has {len(prompt)}")
        return requested or context_length - len(prompt)


def _check_vocabulary(field: str, token_ids, limits: tuple[int, int] | None) -> None:
    if limits is not None and token_ids and not (0 <= min(token_ids) and max(token_ids) < limits[1]):
        raise InvalidRequestError(field, f"token ids must lie in [0, {limits[1]})")
