"""StepOutput: what one step added to one request (the core returns one per request it
advanced; the commit and the drafting steps build them)."""
from __future__ import annotations

from dataclasses import dataclass

from specserve.request.req import Req


@dataclass
class StepOutput:
    req: Req
    new_token_ids: list[int]
    finished: bool


def committed_tokens(outputs: list[StepOutput]) -> int:
    """How many tokens a step committed, all requests together."""
    return sum(len(out.new_token_ids) for out in outputs)
