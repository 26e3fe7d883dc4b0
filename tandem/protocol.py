"""Conversions between tandem.v1 messages and the library's own types, shared by the router and the workers."""

from __future__ import annotations

import asyncio
from dataclasses import fields

from tandem.decision import RoutingDecision, WorkerScore
from tandem.errors import InvalidRequestError
from tandem.sampling import SamplingParams
from tandem.structured import KINDS, StructuredOutput
from tandem.v1 import common_pb2, router_pb2

WORKER_KINDS = {"cpu": common_pb2.WORKER_KIND_CPU, "gpu": common_pb2.WORKER_KIND_GPU}
_KIND_NAMES = {number: name for name, number in WORKER_KINDS.items()}
_SCORE_FIELDS = tuple(f.name for f in fields(WorkerScore) if f.name != "kind")
CHAT_ROLES = ("system", "user", "assistant")


def sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """Validated sampling settings; unset fields keep their defaults.

    Raises:
        InvalidRequestError: with the field named as the API spells it, e.g. ``sampling.top_p``.
    """
    given = {field.name: value for field, value in message.ListFields()}  # each field is named as in SamplingParams
    if "logit_bias" in given:
        given["logit_bias"] = dict(given["logit_bias"])
    if "allowed_token_ids" in given:
        given["allowed_token_ids"] = frozenset(given["allowed_token_ids"])
    try:
        if "structured_output" in given:
            given["structured_output"] = structured_output(given["structured_output"])
        return SamplingParams(**given)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", exc.reason) from None


async def checked_sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """``sampling_params``, with a structured output's grammar checked off the event loop (importing xgrammar
    and compiling a large schema take up to seconds)."""
    if message.HasField("structured_output"):
        return await asyncio.to_thread(sampling_params, message)
    return sampling_params(message)


def structured_output_message(kind: str, spec: str | tuple[str, ...]) -> common_pb2.StructuredOutput:
    """The wire form of a structured output (``tandem.structured.StructuredOutput``'s kind and spec)."""
    if kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=spec))
    return common_pb2.StructuredOutput(**{kind: True if kind == "json_object" else spec})


def structured_output(message: common_pb2.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", "set one of " + ", ".join(KINDS))
    spec = getattr(message, kind)
    return StructuredOutput(kind, tuple(spec.choices) if kind == "choice" else "" if kind == "json_object" else spec)


async def prompt_token_ids(message, tokenizer) -> list[int]:
    """The ``prompt`` of a GenerateRequest or RouteRequest as token ids: as given, encoded from text, or a chat
    rendered with the model's template. Encoding runs off the event loop.

    Raises:
        InvalidRequestError: the prompt is unset or empty, or the chat is invalid; the field is named.
    """
    kind = message.WhichOneof("prompt")
    if kind is None:
        *others, last = (f.name for f in message.DESCRIPTOR.oneofs_by_name["prompt"].fields)
        raise InvalidRequestError("prompt", f"set {', '.join(others)} or {last}")
    if kind == "prompt_token_ids":
        ids = list(message.prompt_token_ids.ids)
    elif kind == "prompt_text":
        ids = message.prompt_text and await asyncio.to_thread(lambda: list(tokenizer(message.prompt_text)["input_ids"]))
    else:
        kind = "chat.messages"
        ids = message.chat.messages and await encode_chat(
            tokenizer, [{"role": m.role, "content": m.content} for m in message.chat.messages], "chat.messages")
    if not ids:
        raise InvalidRequestError(kind, "must not be empty")
    return ids


# Arguments of apply_chat_template that a request's template variables may not replace.
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "chat_template", "tokenize", "return_dict", "tools",
                                 "documents", "add_generation_prompt", "continue_final_message"})


async def encode_chat(tokenizer, conversation: list[dict], field: str, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, template_variables: dict | None = None,
                      tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``conversation`` rendered with the model's chat template: ready for the assistant's turn
    (``add_generation_prompt``), or open at the end of its last message for the model to continue
    (``continue_final_message``); ``template_variables`` go to the template besides the messages. With
    ``tools`` (for a template that renders them), the messages may also be ``tool`` results.

    Raises:
        InvalidRequestError: a role is unknown, the model has no template, or the template rejects the chat.
    """
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("continue_final_message", "cannot be set with add_generation_prompt")
    for name in _TEMPLATE_ARGUMENTS.intersection(template_variables or {}):
        raise InvalidRequestError(f"chat_template_kwargs.{name}", "is set by the request itself, not a template variable")
    roles = (*CHAT_ROLES, "tool") if tools else CHAT_ROLES
    for index, message in enumerate(conversation):
        if message["role"] not in roles:
            raise InvalidRequestError(f"{field}[{index}].role", f"must be one of {', '.join(roles)}")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(field.partition(".")[0], "this model has no chat template; send prompt_text or "
                                                           "prompt_token_ids")
    try:
        return await asyncio.to_thread(lambda: list(tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=True, return_dict=False, **({"tools": tools} if tools else {}), **(template_variables or {}))))
    except Exception as exc:  # the model's template rejected the conversation (jinja raises freely)
        raise InvalidRequestError(field.partition(".")[0], f"the chat template rejected the messages: {exc}") from None


def logprobs_messages(positions) -> list[common_pb2.PositionLogprobs]:
    """``TokenLogprobs`` of an engine as the wire's ``PositionLogprobs``."""
    return [common_pb2.PositionLogprobs(logprob=p.logprob, rank=p.rank, top=[
        common_pb2.TokenLogprob(token_id=token, logprob=logprob) for token, logprob in p.top]) for p in positions]


def decision_message(decision: RoutingDecision) -> router_pb2.RoutingDecision:
    return router_pb2.RoutingDecision(
        policy=decision.policy, chosen_worker=decision.chosen_worker, prompt_tokens=decision.prompt_tokens,
        max_new_tokens=decision.max_new_tokens, failed_workers=decision.failed_workers,
        expected_new_tokens=decision.expected_new_tokens, length_key=decision.length_key,
        moved_from=decision.moved_from, move_reason=decision.move_reason,
        scores=[router_pb2.WorkerScore(kind=WORKER_KINDS[s.kind], **{name: getattr(s, name) for name in _SCORE_FIELDS})
                for s in decision.scores],
    )


def decision_from_message(message: router_pb2.RoutingDecision) -> RoutingDecision:
    return RoutingDecision(
        policy=message.policy, chosen_worker=message.chosen_worker, prompt_tokens=message.prompt_tokens,
        max_new_tokens=message.max_new_tokens, failed_workers=tuple(message.failed_workers),
        expected_new_tokens=message.expected_new_tokens, length_key=message.length_key,
        moved_from=tuple(message.moved_from), move_reason=message.move_reason,
        scores=tuple(WorkerScore(kind=_KIND_NAMES.get(s.kind, ""), **{name: getattr(s, name) for name in _SCORE_FIELDS})
                     for s in message.scores),
    )
