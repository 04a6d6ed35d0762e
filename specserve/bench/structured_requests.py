"""A request of the structured-output workloads (bench/agentic.py, bench/extraction.py) in
OpenAI's shape (messages, tools, tool_choice, a response_format's schema), what it becomes
for the offline Engine (the prompt through the chat template, the grammar as sampling params,
as the server's chat completions build them), and whether an answer is right in form: it
parses and validates against its schema.

A request either forces a tool call (`tools` with tool_choice `required`: the answer must be
one call of a listed function whose arguments validate against that function's parameters)
or asks for JSON (`response_format` json_schema: the answer must validate against the
schema). A chat template that does not render `tools` (SmolLM2's) gets them in the system
prompt, worded as Qwen2.5's template words them, so the model always sees its tools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

_TOOLS_PREAMBLE = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_CLOSING = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True)
class StructuredRequest:
    """A chat conversation up to an assistant turn, and the form its answer must take."""
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "none"            # "required": the answer is a call of one of `tools`
    json_schema: dict | None = None      # the answer is JSON of this schema (response_format)

    def __post_init__(self):
        if (self.tool_choice == "required") == (self.json_schema is not None):
            raise ValueError("StructuredRequest: either tool_choice 'required' with tools or a json_schema, not both")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("StructuredRequest.tools: tool_choice 'required' needs tools")


@dataclass
class EncodedRequest:
    """A request as the offline Engine takes it: token ids, grammar params, and its check."""
    input_ids: list[int]
    sampling_params: dict
    request: StructuredRequest = field(repr=False)
    call_format: str = "qwen"

    def validates(self, text: str) -> bool:
        return answer_validates(self.request, text, self.call_format)


def without_grammar(request: EncodedRequest) -> EncodedRequest:
    """The same prompt with no grammar params: its answer is free text (still checked)."""
    return replace(request, sampling_params={})


def encode_request(engine, request: StructuredRequest) -> EncodedRequest:
    """The prompt and grammar of `request` for `engine` (its tokenizer and chat template)."""
    from specserve.server.tool_calls import QWEN, ToolCalls
    from specserve.server.tool_specs import ToolSpec
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    messages, template_tools, params, call_format = request.messages, None, {}, QWEN
    if request.tools:
        calls = ToolCalls([ToolSpec.model_validate(tool) for tool in request.tools], request.tool_choice,
                          False, template)
        messages, params, call_format = calls.template_messages(messages), calls.grammar_params(), calls.format
        if "tools" in template:
            template_tools = calls.template_tools()
        else:
            messages = tools_in_system_prompt(messages, request.tools)
    if request.json_schema is not None:
        params = {"json_schema": json.dumps(request.json_schema)}
    prompt = engine.apply_chat_template(messages, tools=template_tools)
    return EncodedRequest(engine.tokenizer(prompt).input_ids, params, request, call_format)


def tools_in_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools' signatures appended to the system message (one is added where none leads)."""
    listing = _TOOLS_PREAMBLE + "\n".join(json.dumps(tool) for tool in tools) + _TOOLS_CLOSING
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + listing}, *messages[1:]]
    return [{"role": "system", "content": listing.lstrip()}, *messages]


def answer_validates(request: StructuredRequest, text: str, call_format: str = "qwen") -> bool:
    """Whether `text` is the answer's form: JSON of the request's schema, or exactly one tool
    call naming one of its tools with arguments of that tool's parameters."""
    if request.json_schema is not None:
        try:
            return _valid(json.loads(text), request.json_schema)
        except json.JSONDecodeError:
            return False
    from specserve.server.tool_calls import parse_tool_calls
    _, calls = parse_tool_calls(text, call_format)
    if len(calls) != 1:
        return False
    parameters = {tool["function"]["name"]: tool["function"].get("parameters", {}) for tool in request.tools}
    function = calls[0]["function"]
    return function["name"] in parameters and _valid(json.loads(function["arguments"]), parameters[function["name"]])


def _valid(value: Any, schema: dict) -> bool:
    import jsonschema   # here: only a structured workload's check needs it
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True
