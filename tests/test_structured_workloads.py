"""The structured workloads of the benchmark suite (bench/agentic.py, bench/extraction.py,
bench/structured_requests.py), without a model: the same seed builds the same requests;
agentic conversations alternate one tool call and its result, each call valid against its
tool's schema and drawing on earlier results; every schema is valid and compiles; a request
is rendered with the tools where the chat template takes them, in the system prompt where it
does not, with the grammar of its call format; and an answer is judged valid exactly when it
parses and validates."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from specserve.bench.agentic import SCENARIOS, agentic_requests
from specserve.bench.agentic_tools import REPORT_SCHEMA, TOOLS
from specserve.bench.extraction import SCHEMAS, extraction_records, extraction_requests
from specserve.bench.structured_requests import (StructuredRequest, answer_validates, encode_request,
                                                  tools_in_system_prompt)
from specserve.request.grammar_spec import GrammarSpec, check_grammar


def scalars(value) -> list:
    """Every string and number inside a JSON value."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in scalars(v)]
    if isinstance(value, list):
        return [s for v in value for s in scalars(v)]
    return [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else []


def conversations(requests: list[StructuredRequest]) -> list[list[StructuredRequest]]:
    """The requests grouped by conversation (a new one starts at each system + user pair)."""
    grouped = []
    for request in requests:
        if len(request.messages) == 2:
            grouped.append([])
        grouped[-1].append(request)
    return grouped


@pytest.mark.parametrize("build", [agentic_requests, extraction_requests])
def test_the_same_seed_builds_the_same_requests(build):
    assert build(40, seed=7) == build(40, seed=7)
    assert build(40, seed=7) != build(40, seed=8)
    assert build(25, seed=7) == build(40, seed=7)[:25]
    assert len(build(41, seed=3)) == 41


def test_tool_calls_and_results_alternate_and_each_turn_is_a_request():
    requests = agentic_requests(60, seed=4)
    grouped = conversations(requests)
    assert len(grouped) >= 10
    for turns in grouped[:-1]:   # the last may be cut short by the count
        *calls, report = turns
        assert 3 <= len(calls) <= 4 and all(r.tool_choice == "required" and r.json_schema is None for r in calls)
        assert report.json_schema == REPORT_SCHEMA and report.tool_choice == "none"
        for earlier, later in zip(turns, turns[1:]):   # each turn's prompt extends the one before by a call and its result
            assert later.messages[:len(earlier.messages)] == earlier.messages
            assert len(later.messages) == len(earlier.messages) + 2
        messages = report.messages
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        for call_message, result_message in zip(messages[2::2], messages[3::2]):
            assert call_message["role"] == "assistant" and len(call_message["tool_calls"]) == 1
            call = call_message["tool_calls"][0]
            assert result_message == {"role": "tool", "tool_call_id": call["id"], "content": result_message["content"]}
            json.loads(result_message["content"])
    assert {r.messages[1]["content"].split()[0] for r in requests} >= {"I'm", "Research", "Which", "Customer", "In"}


def test_every_call_is_valid_for_an_offered_tool_and_reuses_earlier_results():
    for turns in conversations(agentic_requests(100, seed=5))[:-1]:
        report = turns[-1]
        offered = {tool["function"]["name"]: tool["function"]["parameters"] for tool in report.tools}
        called = {m["tool_calls"][0]["function"]["name"] for m in report.messages[2::2]}
        assert called < set(offered) and len(offered) == len(report.tools) == len(called) + 2   # two tools to pass over
        earlier_values: set[str] = set()
        for call_message, result_message in zip(report.messages[2::2], report.messages[3::2]):
            function = call_message["tool_calls"][0]["function"]
            arguments = json.loads(function["arguments"])
            jsonschema.validate(arguments, offered[function["name"]])
            if earlier_values:   # every call after the first carries a value an earlier result returned
                assert any(value in function["arguments"] for value in earlier_values), function
            earlier_values |= {str(v) for v in scalars(json.loads(result_message["content"])) if len(str(v)) >= 4}


def test_every_schema_is_valid_and_compiles():
    schemas = [tool["function"]["parameters"] for tool in TOOLS.values()] + [REPORT_SCHEMA, *SCHEMAS.values()]
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        check_grammar(GrammarSpec("json_schema", json.dumps(schema)))


def test_extraction_cycles_the_record_kinds_with_the_record_in_the_prompt():
    requests = extraction_requests(9, seed=2)
    assert [r.json_schema for r in requests] == [SCHEMAS["invoice"], SCHEMAS["contact"], SCHEMAS["product"]] * 3
    for request in requests:
        system, user = request.messages
        assert json.dumps(request.json_schema) in system["content"] and len(user["content"]) > 80
        assert request.tools is None and request.tool_choice == "none"



def test_each_extraction_record_comes_with_its_right_answer():
    """The answer validates and every value of it is written in the record's text (a price
    to two decimals); the requests are extraction_requests' own."""
    records = extraction_records(30, seed=3)
    assert [request for request, _ in records] == extraction_requests(30, seed=3)
    for request, answer in records:
        assert answer_validates(request, json.dumps(answer))
        text = request.messages[-1]["content"]
        for key, value in answer.items():
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, (dict, bool)):   # line items and in_stock are worded
                    written = f"{item:.2f}" if isinstance(item, float) else str(item)
                    assert written in text or str(item) in text, (key, item)

def test_a_request_is_a_forced_call_or_a_schema_and_says_so():
    with pytest.raises(ValueError, match="StructuredRequest"):
        StructuredRequest([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="tools"):
        StructuredRequest([{"role": "user", "content": "hi"}], tool_choice="required")


WEATHER = StructuredRequest([{"role": "user", "content": "weather?"}], [TOOLS["get_weather"], TOOLS["web_search"]],
                            "required")


@pytest.mark.parametrize("answer, valid", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>', True),
    ('<tool_call>{"name": "web_search", "arguments": {"query": "oslo"}}</tool_call>', True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}</tool_call>', False),   # days <= 7
    ('<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>', False),          # city is required
    ('<tool_call>{"name": "send_email", "arguments": {}}</tool_call>', False),                  # not offered
    ('<tool_call>{"name": "web_search", "arguments": {"query": "a"}}</tool_call>'
     '<tool_call>{"name": "web_search", "arguments": {"query": "b"}}</tool_call>', False),       # one call a turn
    ('It will be sunny.', False),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}', False),                # cut short
])
def test_a_tool_call_answer_is_valid_when_it_parses_and_validates(answer, valid):
    assert answer_validates(WEATHER, answer) is valid


def test_a_json_answer_is_valid_when_it_parses_and_validates():
    report = StructuredRequest([{"role": "user", "content": "report"}], json_schema=REPORT_SCHEMA)
    assert answer_validates(report, '{"status": "done", "summary": "ok", "references": ["evt_1"]}')
    assert not answer_validates(report, '{"status": "finished", "summary": "ok", "references": []}')
    assert not answer_validates(report, '{"status": "done", "summary": "ok"')
    assert not answer_validates(report, '{"status": "done", "summary": "ok", "references": [], "extra": 1}')


def test_tools_go_into_the_leading_system_prompt():
    tools = [TOOLS["get_weather"]]
    with_system = tools_in_system_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], tools)
    assert with_system[0]["content"].startswith("Be brief.") and json.dumps(tools[0]) in with_system[0]["content"]
    assert len(with_system) == 2
    without = tools_in_system_prompt([{"role": "user", "content": "x"}], tools)
    assert without[0]["role"] == "system" and "<tools>" in without[0]["content"] and without[1]["role"] == "user"


def test_every_scenario_appears():
    requests = agentic_requests(5 * len(SCENARIOS), seed=9)
    first_calls = {r.messages[2]["tool_calls"][0]["function"]["name"] for r in requests if len(r.messages) == 4}
    assert first_calls == {"get_weather", "web_search", "run_sql", "lookup_customer", "list_directory"}


class TemplateOnlyEngine:
    """What encode_request reads of an engine: a tokenizer with a chat template, and the
    template's rendering (recorded here)."""

    def __init__(self, chat_template: str):
        self.tokenizer = lambda text: SimpleNamespace(input_ids=[len(text)])
        self.tokenizer.chat_template = chat_template
        self.rendered: list[tuple[list[dict], list[dict] | None]] = []

    def apply_chat_template(self, messages, tools=None):
        self.rendered.append((messages, tools))
        return json.dumps(messages)


QWEN_TEMPLATE = "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>{{ message.tool_calls }}"
LLAMA_TEMPLATE = "{% if tools %}{{ tools }}{% endif %}<|python_tag|>{{ message.tool_calls }}"


@pytest.mark.parametrize("template, call_format", [(QWEN_TEMPLATE, "qwen"), (LLAMA_TEMPLATE, "llama")])
def test_a_template_that_renders_tools_gets_them_and_its_own_call_format(template, call_format):
    engine = TemplateOnlyEngine(template)
    second_turn, *_, report = next(turns for turns in conversations(agentic_requests(12, seed=1)))[1:]
    encoded = encode_request(engine, second_turn)
    messages, tools = engine.rendered[-1]
    assert tools == second_turn.tools and messages[0] == second_turn.messages[0]   # the system prompt as written
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == json.loads(
        second_turn.messages[2]["tool_calls"][0]["function"]["arguments"])          # a dict, as HF templates want
    assert encoded.call_format == call_format and set(encoded.sampling_params) == {"structural_tag"}
    assert json.loads(encode_request(engine, report).sampling_params["json_schema"]) == REPORT_SCHEMA


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text():
    engine = TemplateOnlyEngine("{{ message.content }}")
    second_turn = agentic_requests(2, seed=1)[1]
    encoded = encode_request(engine, second_turn)
    messages, tools = engine.rendered[-1]
    assert tools is None and "<tools>" in messages[0]["content"] and encoded.call_format == "qwen"
    assert messages[2]["content"].startswith("<tool_call>")   # the earlier call written as the model writes it
