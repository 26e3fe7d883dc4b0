"""Tool calls for the OpenAI front end, in one generic format that any chat template can carry.

Tandem does not parse each model family's own tool format. As llama.cpp's server does for templates without
native tool support, the tools are described in a system message, with the instruction to answer a call as
one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``; earlier calls and their results in
the history are written the same way, as plain messages. ``tool_choice`` ``required`` or a named function
holds the output to that object's JSON schema (structured output), so the arguments always parse against
the function's schema; under ``auto`` the model chooses, and an output that is not such an object is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.errors import InvalidRequestError

CALLS_KEY = "tool_calls"
AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class Call:
    """A call the model made: its id (``call_...``), the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class ToolUse:
    """A request's tools and how the model may use them.

    Args:
        tools: the functions on offer.
        choice: ``auto``, ``none``, ``required``, or the name of the one function to call.
        parallel: whether one reply may make several calls.
    """

    def __init__(self, tools: list[Tool], choice: str, parallel: bool):
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        named = choice not in (AUTO, NONE, REQUIRED)
        if named and choice not in {tool.name for tool in tools}:
            raise InvalidRequestError("tool_choice", f"names no function among the tools: {choice!r}")

    @property
    def active(self) -> bool:
        """The model may call (or, under ``required`` or a named function, must call) a function."""
        return bool(self.tools) and self.choice != NONE

    @property
    def forced(self) -> bool:
        return self.active and self.choice != AUTO

    def prompt(self) -> str:
        """The system message's text that describes the tools and the format of a call."""
        listed = json.dumps([{"name": tool.name, "description": tool.description, "parameters": tool.parameters}
                             for tool in self._offered()])
        how = "one call" if not self.parallel else "one or more calls"
        must = "You must call a function." if self.forced else \
            "If a function helps, call it; otherwise answer in plain text."
        return (f"You can call these functions:\n{listed}\n{must} To call, reply with only a JSON object, {how} in "
                f'its list: {{"{CALLS_KEY}": [{{"name": "<function name>", "arguments": {{<the arguments>}}}}]}}')

    def schema(self) -> dict:
        """The JSON schema of a reply that calls (``required`` or a named function)."""
        call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": tool.name},
                                          "arguments": tool.parameters or {"type": "object"}}}
                          for tool in self._offered()]}
        calls = {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
        return {"type": "object", "additionalProperties": False, "required": [CALLS_KEY],
                "properties": {CALLS_KEY: calls}}

    def calls(self, text: str) -> list[Call] | None:
        """The calls in a reply, or None where it is not a call of an offered function."""
        try:
            reply = json.loads(text)
        except ValueError:
            return None
        listed = reply.get(CALLS_KEY) if isinstance(reply, dict) and set(reply) == {CALLS_KEY} else None
        names = {tool.name for tool in self._offered()}
        if not isinstance(listed, list) or not listed or (len(listed) > 1 and not self.parallel) or not all(
                isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)
                for call in listed):
            return None
        return [Call(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(call["arguments"])) for call in listed]

    def _offered(self) -> list[Tool]:
        return self.tools if self.choice in (AUTO, REQUIRED) else [t for t in self.tools if t.name == self.choice]


class HeldReply:
    """One streamed choice's text while it may still be a call: all of it under a forced choice; under ``auto``,
    what comes before its first visible character, and everything from there on if that is ``{``. ``feed``
    gives back what may stream as content now; ``end`` the calls, or the held text as content."""

    def __init__(self, tool_use: ToolUse):
        self.tool_use = tool_use
        self.held: list[str] = []
        self.holding: bool | None = True if tool_use.forced else None  # None: not decided yet

    def feed(self, text: str) -> str:
        if self.holding is False:
            return text
        self.held.append(text)
        if self.holding is None and "".join(self.held).strip():
            self.holding = "".join(self.held).lstrip().startswith("{")
            if not self.holding:
                return self._release()
        return ""

    def end(self) -> tuple[list[Call] | None, str]:
        """(the calls, "") where the held text is a call, else (None, the held text)."""
        calls = self.tool_use.calls("".join(self.held)) if self.held else None
        return (calls, "") if calls else (None, self._release())

    def _release(self) -> str:
        text, self.held = "".join(self.held), []
        return text


def written_calls(calls: list[tuple[str, str]]) -> str:
    """Earlier calls ((name, arguments as JSON text)) as the model wrote them."""
    return json.dumps({CALLS_KEY: [{"name": name, "arguments": _arguments(arguments)} for name, arguments in calls]})


def written_result(name: str, call_id: str, content: str) -> str:
    """A function's result, as the message after the call reads it."""
    return f"The result of {name or 'the function'} (call {call_id}):\n{content}"


def _arguments(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
