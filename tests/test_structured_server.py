"""Structured output and tool calls through `launch_server` (SmolLM2, NGRAM, CPU): OpenAI's
response_format (json_object, json_schema) in chat and completions, SGLang's /generate
fields json_schema / regex / ebnf, 400s naming the bad field, and the `openai` client's
tool-calling loop (the model calls a tool, gets its result, answers) with the call forced
by a grammar, whole and streamed: the format is tested, not the model's judgement."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_process import free_port, start_server, stop_server
from lab.server_overhead import wait_healthy

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
COPY = [{"role": "user", "content": 'Copy this JSON exactly: {"city": "Paris", "population": 2100000}'}]


@pytest.fixture(scope="module")
def env():
    port = free_port()
    proc = start_server(port, "--max-total-tokens", "8192", "--speculative-algorithm", "NGRAM",
                        "--speculative-num-draft-tokens", "4")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield base_url, client
    finally:
        stop_server(proc)


def test_chat_response_format_json_schema_and_json_object(env):
    _, client = env
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for temperature in (0.0, 0.9):
        reply = client.chat.completions.create(model="m", messages=COPY, max_tokens=64, temperature=temperature,
                                               seed=3, response_format=schema_format)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
    reply = client.chat.completions.create(model="m", messages=COPY, max_tokens=64, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_streamed_json_schema_and_completions(env):
    _, client = env
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    stream = client.chat.completions.create(model="m", messages=COPY, max_tokens=64, temperature=0,
                                            response_format=schema_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)
    completion = client.completions.create(model="m", prompt='A city as JSON: ', max_tokens=64, temperature=0,
                                           extra_body={"response_format": schema_format})
    jsonschema.validate(json.loads(completion.choices[0].text), CITY)


def test_generate_fields(env):
    base_url, _ = env
    prompt = "<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\n"
    cases = [("json_schema", json.dumps(CITY), lambda text: jsonschema.validate(json.loads(text), CITY)),
             ("regex", r"(yes|no)\. [A-Z][a-z ]{2,20}\.", lambda text: re.fullmatch(r"(yes|no)\. [A-Z][a-z ]{2,20}\.", text)),
             ("ebnf", 'root ::= "Answer: " ("yes" | "no")', lambda text: text in ("Answer: yes", "Answer: no"))]
    copy = "<|im_start|>user\n" + COPY[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    for field, grammar, check in cases:
        body = {"text": copy if field == "json_schema" else prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 64, field: grammar}}
        out = httpx.post(base_url + "/generate", json=body, timeout=120).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert check(out["text"]) is not False, out["text"]


@pytest.mark.parametrize("route, body, field", [
    ("/v1/chat/completions", {"messages": COPY, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objjject"}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": COPY, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": COPY, "regex": "a(b"}, "regex"),
    ("/v1/chat/completions", {"messages": COPY, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objjject"}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": COPY, "tools": [WEATHER_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": COPY, "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= missing"}}, "ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(", "json_schema": "{}"}}, "at most one"),
])
def test_bad_grammars_are_400s_naming_the_field(env, route, body, field):
    base_url, _ = env
    response = httpx.post(base_url + route, json=body if route == "/generate" else {"model": "m", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"], response.text
    ok = httpx.post(base_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


def run_tool_loop(client, stream: bool) -> tuple[list, str]:
    """The client's tool-use loop: ask, get a forced call, run the tool, send its result, get an answer."""
    messages = [{"role": "system", "content": "You can call tools."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="m", tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=64, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(messages=messages, tool_choice=forced, stream=True, **kwargs))
        calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        assert all(call.index == 0 for call in calls) and len(calls) == 1
    else:
        reply = client.chat.completions.create(messages=messages, tool_choice=forced, **kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].message.content is None
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "sunny, 21 C"})})
    answer = client.chat.completions.create(messages=messages, tool_choice="none", **kwargs)
    return calls, answer.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_tool_calling_loop(env, stream):
    _, client = env
    calls, answer = run_tool_loop(client, stream)
    assert len(calls) == 1 and answer   # the tool's result went in, a text answer came out


def test_required_tool_choice_calls_one_of_the_tools(env):
    _, client = env
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What time is it in Rome?"}], tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required", max_tokens=96, temperature=0, parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    assert "city" in json.loads(calls[0].function.arguments)
