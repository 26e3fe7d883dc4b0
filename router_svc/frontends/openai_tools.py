"""Tool calls for the OpenAI front end.

Under ``tool_choice`` ``auto``, a chat template that renders tools (``renders_tools``) gets them, and the
history's calls and results, as it expects them (``native``); the reply is read back in the formats such
templates teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen) or one
bare ``{"name": ..., "arguments"|"parameters": {...}}`` object (Llama 3). Otherwise, as llama.cpp's server
does for templates without tool support, one generic format that any template carries: the tools described
in a system message, with the instruction to answer a call as one JSON object,
``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, and earlier calls and their results written the same
way, as plain messages. ``required`` or a named function always uses the generic format and holds the output
to that object's JSON schema (structured output), so the arguments always parse against the function's
schema; under ``auto`` the model chooses, and an output that is not a call is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tandem.errors import InvalidRequestError

CALLS_KEY = "tool_calls"
AUTO, NONE, REQUIRED = "auto", "none", "required"
_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PROBE = "tandem_probe_function"


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template writes the tools it is given (a template without tool support ignores
    them)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that rejects the argument renders no tools
        return False
    return _PROBE in rendered


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
        template_renders_tools: the chat template renders tools (``renders_tools``); used under ``auto``.
    """

    def __init__(self, tools: list[Tool], choice: str, parallel: bool, template_renders_tools: bool = False):
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        self.native = template_renders_tools and choice == AUTO and bool(tools)
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

    def template_tools(self) -> list[dict] | None:
        """The tools as a chat template takes them, where it renders them (``native``)."""
        if not self.native:
            return None
        return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                  "parameters": tool.parameters or {"type": "object"}}}
                for tool in self.tools]

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
        """The calls in a reply, or None where it is not a call of offered functions: in the generic format,
        or, where the template renders tools, in the formats such templates teach."""
        reply = _json(text)
        listed = reply.get(CALLS_KEY) if isinstance(reply, dict) and set(reply) == {CALLS_KEY} else None
        if listed is None and self.native:
            tagged = _TAGGED_CALL.findall(text)
            if tagged and not _TAGGED_CALL.sub("", text).strip():
                listed = [_json(call) for call in tagged]
            elif isinstance(reply, dict) and "name" in reply:
                listed = [{"name": reply.get("name"), "arguments": reply.get("arguments", reply.get("parameters"))}]
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
    what comes before its first visible character, and everything from there on if that is ``{`` (or ``<``,
    where the template renders tools). ``feed``
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
            self.holding = "".join(self.held).lstrip()[0] in ("{<" if self.tool_use.native else "{")
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


def call_message(tool_use: ToolUse, text: str, calls: list[tuple[str, str, str]]) -> dict:
    """An assistant message of the history that made ``calls`` ((id, name, arguments as JSON text)), as the
    template takes it."""
    if tool_use.native:
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}
            for call_id, name, arguments in calls]}
    written = json.dumps({CALLS_KEY: [{"name": name, "arguments": _arguments(arguments)}
                                      for _, name, arguments in calls]})
    return {"role": "assistant", "content": f"{text}\n{written}" if text else written}


def result_message(tool_use: ToolUse, call_id: str, name: str, content: str) -> dict:
    """A call's result in the history, as the template takes it."""
    if tool_use.native:
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
    return {"role": "user", "content": f"The result of {name or 'the function'} (call {call_id}):\n{content}"}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _arguments(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
