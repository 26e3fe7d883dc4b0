"""The generic tool format of the OpenAI front end (router_svc/frontends/openai_tools.py)."""

from __future__ import annotations

import json

import pytest

from router_svc.frontends.openai_tools import HeldReply, Tool, ToolUse
from tandem.errors import InvalidRequestError

WEATHER = Tool("get_weather", "The weather", {"type": "object", "properties": {"city": {"type": "string"}}})
TIME = Tool("get_time", "", {})


def reply(*calls) -> str:
    return json.dumps({"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls]})


def test_a_reply_is_calls_only_when_it_calls_offered_functions_with_object_arguments():
    tools = ToolUse([WEATHER, TIME], "auto", parallel=True)
    calls = tools.calls(reply(("get_weather", {"city": "Oslo"}), ("get_time", {})))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    for text in ("Sunny.", "{", reply(("other", {})), reply(("get_time", "now")), json.dumps({"tool_calls": []}),
                 json.dumps({"tool_calls": [{"name": "get_time", "arguments": {}}], "extra": 1}), "[1, 2]"):
        assert tools.calls(text) is None, text
    single = ToolUse([WEATHER, TIME], "auto", parallel=False)
    assert single.calls(reply(("get_time", {}), ("get_time", {}))) is None
    named = ToolUse([WEATHER, TIME], "get_time", parallel=True)
    assert named.calls(reply(("get_weather", {}))) is None and named.calls(reply(("get_time", {})))


def test_the_schema_of_a_forced_call_offers_the_chosen_functions():
    required = ToolUse([WEATHER, TIME], "required", parallel=False).schema()
    calls = required["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and calls["minItems"] == 1
    assert [option["properties"]["name"] for option in calls["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                   {"const": "get_time"}]
    named = ToolUse([WEATHER, TIME], "get_weather", parallel=True).schema()["properties"]["tool_calls"]
    assert "maxItems" not in named and [o["properties"]["arguments"] for o in named["items"]["anyOf"]] == \
        [WEATHER.parameters]
    with pytest.raises(InvalidRequestError) as info:
        ToolUse([WEATHER], "get_time", parallel=True)
    assert info.value.field == "tool_choice"
    assert not ToolUse([WEATHER], "none", parallel=True).active and not ToolUse([], "auto", parallel=True).active


@pytest.mark.parametrize("choice, pieces, streamed, calls", [
    ("auto", ["  ", "Sun", "ny."], ["", "  Sun", "ny."], False),
    ("auto", [" {\"tool_calls\": [{\"name\": \"get_time\", ", "\"arguments\": {}}]}"], ["", ""], True),
    ("auto", ["{not a call}"], [""], False),
    ("required", ["Sunny"], [""], False),
])
def test_held_text_streams_once_it_is_known_not_to_be_a_call(choice, pieces, streamed, calls):
    held = HeldReply(ToolUse([WEATHER, TIME], choice, parallel=True))
    assert [held.feed(piece) for piece in pieces] == streamed
    found, rest = held.end()
    assert bool(found) == calls
    assert "".join(streamed) + rest == ("" if calls else "".join(pieces))
