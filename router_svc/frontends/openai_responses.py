"""The objects of the OpenAI Responses API: the response, and the events of its stream, as the SDKs parse them.
The output is the assistant's message, or the function calls it made (``router_svc.frontends.openai_tools``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router_svc.frontends.openai_schema import ResponsesRequest
from router_svc.frontends.openai_tools import Call, ToolUse
from tandem.v1 import common_pb2, worker_pb2


@dataclass
class ResponseObjects:
    """Makes the response and stream events of one Responses request. Its output is the assistant's message, of
    one ``output_text`` part, or one ``function_call`` item per call."""

    id: str
    body: ResponsesRequest
    tool_use: ToolUse
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence_number: int = 0

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def response(self, text: str | None = None, result: worker_pb2.GenerateResult | None = None,
                 calls: list[Call] | None = None) -> dict:
        """The response object: in progress (no ``text`` yet), or done with ``text`` (or the ``calls`` it made)
        and the worker's ``result``."""
        body = self.body
        done = result is not None
        incomplete = done and not calls and result.finish_reason == common_pb2.FINISH_REASON_LENGTH
        if not done:
            output = []
        elif calls:
            output = [self.call_item(position, call, "completed") for position, call in enumerate(calls)]
        else:
            output = [self.message(text, "incomplete" if incomplete else "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": body.model,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
            else self.tool_use.choice, "parallel_tool_calls": body.parallel_tool_calls,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "truncation": "disabled", "store": False, "previous_response_id": None, "metadata": body.metadata or {},
            "output": output, "usage": _usage(result.usage) if done else None,
        }

    def call_item(self, position: int, call: Call, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{self.id.removeprefix('resp_')}_{position}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def opening_events(self) -> list[dict]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def message_opening_events(self) -> list[dict]:
        return [self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part=_text_part(""))]

    def call_events(self, calls: list[Call], result: worker_pb2.GenerateResult) -> list[dict]:
        """Each call as its item is added, its arguments streamed and done, then the response completed."""
        events = []
        for position, call in enumerate(calls):
            item_id = self.call_item(position, call, "completed")["id"]
            events += [self.event("response.output_item.added", output_index=position,
                                  item=self.call_item(position, call, "in_progress")),
                       self.event("response.function_call_arguments.delta", item_id=item_id, output_index=position,
                                  delta=call.arguments),
                       self.event("response.function_call_arguments.done", item_id=item_id, output_index=position,
                                  arguments=call.arguments),
                       self.event("response.output_item.done", output_index=position,
                                  item=self.call_item(position, call, "completed"))]
        return [*events, self.event("response.completed", response=self.response(None, result, calls))]

    def delta_event(self, delta: str) -> dict:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=delta, logprobs=[])

    def closing_events(self, text: str, result: worker_pb2.GenerateResult) -> list[dict]:
        response = self.response(text, result)
        return [self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                           part=_text_part(text)),
                self.event("response.output_item.done", output_index=0, item=response["output"][0]),
                self.event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                           response=response)]

    def event(self, kind: str, **fields) -> dict:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: common_pb2.Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.output_tokens}
