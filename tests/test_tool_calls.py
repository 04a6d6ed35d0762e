"""Tool-call handling without a model: the format read from a chat template, the model's
output parsed into OpenAI tool_calls (Qwen's <tool_call> blocks, Llama-3.1's bare JSON),
whole and streamed in pieces, the conversation's calls handed to a template, and the
grammar that forces a call in each format."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specserve.server.tool_calls import LLAMA, QWEN, ToolCalls, ToolCallStream, parse_tool_calls, stream_delta, \
    tool_call_format
from specserve.server.tool_specs import NamedToolChoice, ToolSpec

WEATHER = ToolSpec.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
QWEN_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{% if message.tool_calls %}"
LLAMA_TEMPLATE = "Environment: ipython{% if message.tool_calls %}<|python_tag|>"


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def test_format_from_the_template():
    assert tool_call_format(QWEN_TEMPLATE) == QWEN
    assert tool_call_format(LLAMA_TEMPLATE) == LLAMA
    assert tool_call_format("{{ messages }}") == QWEN and tool_call_format(None) == QWEN


def test_qwen_calls_parse_and_leave_the_rest_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, QWEN)
    assert content == "Let me check."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", QWEN) == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls("no calls", QWEN) == ("no calls", [])


def test_llama_calls_parse_one_or_several():
    content, calls = parse_tool_calls(' {"name": "get_weather", "parameters": {"city": "Rome"}}', LLAMA)
    assert content is None and names_and_arguments(calls) == [("get_weather", {"city": "Rome"})]
    _, calls = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', LLAMA)
    assert names_and_arguments(calls) == [("a", {}), ("b", {"x": 1})]
    for text in ('The answer is {"name": "a"}', '{"name": "a", "parameters": {}} and more', '{"city": "Rome"}'):
        assert parse_tool_calls(text, LLAMA) == (text, [])


@pytest.mark.parametrize("fmt, pieces, content", [
    (QWEN, ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"],
     "Sure. "),
    (LLAMA, [" ", "{\"name\": \"get_weather\", \"parameters\"", ": {\"city\": \"Oslo\"}}"], ""),
])
def test_streamed_calls_arrive_whole_at_the_end_and_content_is_never_a_call(fmt, pieces, content):
    split = ToolCallStream(fmt)
    deltas = [stream_delta(split, piece, last=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(d.get("content", "") for d in deltas) == content
    assert all("tool_calls" not in d for d in deltas[:-1])
    calls = deltas[-1]["tool_calls"]
    assert [c["index"] for c in calls] == [0]
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"})]


def test_streamed_text_without_calls_is_all_content():
    for fmt in (QWEN, LLAMA, None):
        split = ToolCallStream(fmt)
        pieces = ["It is <", "b>sunny</b> {no call", "}."]
        deltas = [stream_delta(split, piece, last=i == 2) for i, piece in enumerate(pieces)]
        assert "".join(d.get("content", "") for d in deltas) == "".join(pieces)
        assert not any("tool_calls" in d for d in deltas)


def test_conversation_calls_for_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    rendering = ToolCalls([WEATHER], "auto", True, QWEN_TEMPLATE).template_messages(messages)
    assert rendering[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}   # a dict, as HF templates want
    assert rendering[0]["content"] == "" and rendering[1] == messages[1]
    as_text = ToolCalls([WEATHER], "auto", True, "{{ messages }}").template_messages(messages)   # no tool_calls support
    assert as_text[0]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    llama = ToolCalls([WEATHER], "auto", True, "ipython").template_messages(messages)
    assert json.loads(llama[0]["content"]) == {"name": "get_weather", "parameters": {"city": "Paris"}}


@pytest.mark.parametrize("template, begin", [(QWEN_TEMPLATE, '<tool_call>\n{"name": "get_weather", "arguments": '),
                                             (LLAMA_TEMPLATE, '{"name": "get_weather", "parameters": ')])
def test_forced_calls_get_the_formats_grammar(template, begin):
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    for choice in ("required", named):
        params = ToolCalls([WEATHER], choice, True, template).grammar_params()
        assert json.dumps(begin)[1:-1] in params["structural_tag"]   # the call's opening, JSON-escaped
    for choice in ("auto", "none"):
        assert ToolCalls([WEATHER], choice, True, template).grammar_params() == {}
    assert not ToolCalls([WEATHER], "none", True, template).parses


def test_none_keeps_a_call_shaped_answer_as_text():
    tools = ToolCalls([WEATHER], "none", True, QWEN_TEMPLATE)
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert tools.message(text) == ({"role": "assistant", "content": text}, False)
    message, called = ToolCalls.of(SimpleNamespace(tools=[WEATHER], tool_choice=None, parallel_tool_calls=True),
                                   QWEN_TEMPLATE).message(text)
    assert called and message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
