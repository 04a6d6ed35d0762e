"""Tool calls in chat completions: the model's tool-call format (read from its chat
template), the grammar that forces a call (`tool_choice` required or a named function,
through xgrammar's structural tag of that format), the conversation's tool calls handed to
the template, and the model's output parsed into OpenAI `tool_calls`, whole or streamed.

Formats: Qwen2.5 / Qwen3 (Hermes style) put each call in `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`; Llama-3.1 answers with the bare JSON object `{"name": ...,
"parameters": {...}}`. A template that shows neither uses the Qwen format.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from specserve.server.tool_specs import NamedToolChoice, ToolSpec, forces_a_call

QWEN, LLAMA = "qwen", "llama"
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# xgrammar's structural-tag builders of each format (Qwen2.5's is Qwen3's without reasoning)
_XGRAMMAR_MODEL = {QWEN: ("qwen_3", {"reasoning": False}), LLAMA: ("llama", {})}


def tool_call_format(chat_template: str | None) -> str:
    template = chat_template or ""
    if QWEN_OPEN in template:
        return QWEN
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA
    return QWEN


class ToolCalls:
    """One request's tools: what they add to its prompt, its sampling params and its answer."""

    def __init__(self, tools: list[ToolSpec], tool_choice: Any, parallel: bool, chat_template: str | None):
        self.tools, self.tool_choice, self.parallel = tools, tool_choice, parallel
        self.format = tool_call_format(chat_template)
        # a template that does not render an assistant's tool_calls gets them as its text
        self.calls_as_text = "tool_calls" not in (chat_template or "")

    @classmethod
    def of(cls, body, chat_template: str | None) -> "ToolCalls | None":
        """None where the request has no tools."""
        if not body.tools:
            return None
        return cls(body.tools, body.tool_choice or "auto", body.parallel_tool_calls, chat_template)

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls (not with tool_choice none)."""
        return self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def grammar_params(self) -> dict[str, str]:
        """The structural tag that forces a call, for tool_choice required or a named function."""
        if not forces_a_call(self.tool_choice):
            return {}
        import xgrammar
        model, options = _XGRAMMAR_MODEL[self.format]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        tag = xgrammar.get_model_structural_tag(model, tools=self.template_tools(), tool_choice=choice,
                                                parallel_tool_calls=self.parallel, **options)
        return {"structural_tag": tag.model_dump_json()}

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """The conversation for the chat template: a call's arguments as a dict (what HF
        templates render), and, where the template ignores tool_calls, the calls as text."""
        out = []
        for message in messages:
            calls = message.get("tool_calls")
            if calls:
                calls = [_template_call(call) for call in calls]
                message = {**message, "tool_calls": calls}
                if self.calls_as_text:
                    text = "\n".join(self.render(call["function"]) for call in calls)
                    message["content"] = (message["content"] + "\n" if message["content"] else "") + text
            out.append(message)
        return out

    def render(self, function: dict) -> str:
        """One call as the model writes it."""
        if self.format == LLAMA:
            return json.dumps({"name": function["name"], "parameters": function.get("arguments", {})})
        call = json.dumps({"name": function["name"], "arguments": function.get("arguments", {})})
        return f"{QWEN_OPEN}\n{call}\n{QWEN_CLOSE}"

    def message(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a whole answer, and whether it holds tool calls."""
        content, calls = parse_tool_calls(text, self.format) if self.parses else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self.format if self.parses else None)


class ToolCallStream:
    """A streamed answer's text split into content deltas and, at its end, tool calls: text
    that may begin a call is held back until the answer ends, then parsed."""

    def __init__(self, fmt: str | None):
        self.format = fmt
        self.text = ""      # the whole answer so far
        self.sent = 0       # characters of it sent as content
        self.holding = False

    def feed(self, delta: str) -> str:
        """The content to send now for a new piece of the answer."""
        self.text += delta
        if self.format is None:
            return self._send_to(len(self.text))
        if self.holding:
            return ""
        start = self._call_start()
        if start is not None:
            self.holding = True
            return self._send_to(start)
        return self._send_to(len(self.text) - self._undecided())

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, the tool calls) once the answer has ended."""
        if not self.holding:
            return self._send_to(len(self.text)), []
        content, calls = parse_tool_calls(self.text[self.sent:], self.format)
        self.sent = len(self.text)
        return content or "", calls

    def _call_start(self) -> int | None:
        if self.format == QWEN:
            index = self.text.find(QWEN_OPEN)
            return index if index >= 0 else None
        # Llama-3.1: a call is the whole answer, a JSON object from its first character on
        return 0 if self.sent == 0 and self.text.lstrip().startswith("{") else None

    def _undecided(self) -> int:
        """Trailing characters that may still begin a call (held back)."""
        if self.format == QWEN:
            return _partial_marker(self.text, QWEN_OPEN)
        return len(self.text) if self.sent == 0 and not self.text.strip() else 0

    def _send_to(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(the content without the calls, None if nothing is left; the calls as OpenAI's
    tool_calls). Text that does not parse as a call stays content."""
    calls, content = [], text
    if fmt == QWEN:
        for match in _QWEN_CALL.finditer(text):
            call = _as_call(match.group(1), "arguments")
            if call is not None:
                calls.append(call)
                content = content.replace(match.group(0), "", 1)
    else:
        calls = _llama_calls(text.strip())
        content = "" if calls else text
    content = content.strip() if calls else content
    return (content or None) if calls else content, calls


def _llama_calls(text: str) -> list[dict]:
    """Llama-3.1's answer: one JSON call, or several separated by ';' (all or nothing)."""
    if not text.startswith("{"):
        return []
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return []
        call = _call_of(value, "parameters")
        if call is None:
            return []
        calls.append(call)
        position = end
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
    return calls


def _as_call(text: str, arguments_key: str) -> dict | None:
    try:
        return _call_of(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _call_of(value: Any, arguments_key: str) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def _partial_marker(text: str, marker: str) -> int:
    """How many trailing characters of `text` begin `marker` (held back: a call may start there)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def stream_delta(split: ToolCallStream, text: str, last: bool) -> dict:
    """A chat chunk's delta: the content that may go out now and, on the last chunk, the tool
    calls (each whole, with its index, as OpenAI's stream deltas carry them)."""
    content = split.feed(text)
    calls = []
    if last:
        rest, calls = split.finish()
        content += rest
    delta = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(calls)]
    return delta
