"""The generic tool format of the OpenAI front end (router_svc/frontends/openai_tools.py)."""

from __future__ import annotations

import json

import pytest

from router_svc.frontends.openai_tools import HeldReply, Tool, ToolUse, renders_tools
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


TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny test tokenizer, whose template ignores tools, and the same with a template that renders them."""
    from tests.models import build_tokenizer

    plain = build_tokenizer(tmp_path_factory.mktemp("plain"))
    tooled = build_tokenizer(tmp_path_factory.mktemp("tooled"))
    tooled.chat_template = TOOLS_TEMPLATE
    return plain, tooled


def test_a_template_that_renders_tools_gets_them_and_the_history_as_it_expects(tokenizers):
    from router_svc.frontends.openai_schema import ChatCompletionRequest

    plain, tooled = tokenizers
    assert not renders_tools(plain) and renders_tools(tooled)
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]})
    native = body.tool_use(template_renders_tools=True)
    assert native.native and native.template_tools()[0]["function"]["name"] == "get_weather"
    rendered = tooled.apply_chat_template(body.conversation(native), tools=native.template_tools(),
                                          add_generation_prompt=True, tokenize=False)
    assert "Tools: get_weather" in rendered
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert "<s>tool\n3 C</s>" in rendered
    generic = body.tool_use(template_renders_tools=False)
    conversation = body.conversation(generic)
    assert conversation[0]["role"] == "system" and "get_weather" in conversation[0]["content"]
    assert conversation[-1] == {"role": "user", "content": "The result of get_weather (call c1):\n3 C"}
    forced = ChatCompletionRequest.model_validate({**body.model_dump(exclude_none=True), "tool_choice": "required"})
    assert not forced.tool_use(template_renders_tools=True).native  # required is held to the generic format


def test_the_call_formats_templates_teach_are_read_back():
    tools = ToolUse([WEATHER, TIME], "auto", parallel=True, template_renders_tools=True)
    tagged = tools.calls('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in tagged] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    bare = tools.calls('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert [(c.name, json.loads(c.arguments)) for c in bare] == [("get_weather", {"city": "Rome"})]
    assert tools.calls('It is sunny. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>') is None
    assert tools.calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>') is None
    generic_only = ToolUse([WEATHER], "auto", parallel=True)
    assert generic_only.calls('{"name": "get_weather", "parameters": {}}') is None
    held = HeldReply(tools)
    assert held.feed("<tool_call>") == "" and held.feed('{"name": "get_time", "arguments": {}}</tool_call>') == ""
    assert held.end()[0][0].name == "get_time"
