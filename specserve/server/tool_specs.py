"""The `tools` and `tool_choice` fields of a chat completion request (OpenAI's shapes), and
their checks when the body is parsed: each tool's parameters a valid JSON schema, a named
choice one of the tools, a forced call not combined with a JSON response_format."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.request.grammar_spec import GrammarSpec, check_grammar


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def forces_a_call(tool_choice: Any) -> bool:
    """`required` or a named function: the output must be a tool call."""
    return tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)


def check_tool_choice(tools: list[ToolSpec] | None, tool_choice: Any, response_format: Any) -> None:
    """ValueError naming the field that is wrong."""
    if tool_choice not in (None, "none", "auto") and not tools:
        raise ValueError("tool_choice: a tool choice other than none or auto needs tools")
    for index, tool in enumerate(tools or []):
        if tool.function.parameters is not None:
            try:
                check_grammar(GrammarSpec("json_schema", json.dumps(tool.function.parameters)))
            except ValueError as error:
                raise ValueError(f"tools[{index}].function.parameters: {error}") from None
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice: function {tool_choice.function.name!r} is not among the tools")
    if tools and forces_a_call(tool_choice) and response_format is not None and response_format.type != "text":
        raise ValueError("response_format: a JSON response_format cannot be combined with a tool_choice that forces a call")
