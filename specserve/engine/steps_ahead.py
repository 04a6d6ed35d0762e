"""StepsAhead: the steps launched before the scheduler asked for them, and the bookkeeping of
a plain step that waits until the step after it is launched. Every step pipeline shares it.

At most one step is ahead: a plain greedy step on the overlap schedule (overlap.py) or a
greedy drafting step (draft_ahead.py). A plain step's after-work (its tokens shown to the
drafter and the policy, its probe and price) is put off while a drafter runs and more work
is queued: it runs (`settle`) once the next step is launched, or before anything reads the
drafter's or the policy's state (a drafting step, an abort, a preemption).
"""
from __future__ import annotations

from typing import Protocol

from specserve.engine.draft_ahead import DraftAhead
from specserve.engine.overlap import OverlapSchedule
from specserve.request.req import Req


class AfterWork(Protocol):
    def run(self) -> None: ...


class StepsAhead:
    def __init__(self, plain: OverlapSchedule | None, drafting: DraftAhead | None):
        self.plain = plain          # plain greedy steps one step ahead (None: never)
        self.drafting = drafting    # greedy drafting steps launched before their bookkeeping (None: never)
        self.after_plain: AfterWork | None = None   # a plain step's bookkeeping, put off (plain_step.py)

    def settle(self) -> None:
        """Runs the plain step's bookkeeping that waited for the next launch, if any."""
        work, self.after_plain = self.after_plain, None
        if work is not None:
            work.run()

    def drop(self) -> None:
        """Forgets the steps launched ahead, if any, and frees their slots."""
        if self.plain is not None:
            self.plain.drop()
        if self.drafting is not None:
            self.drafting.drop()

    def plain_step_for(self, reqs: list[Req]) -> bool:
        """Whether a plain step for exactly these requests is already on the GPU."""
        return self.plain is not None and self.plain.holds_step_for(reqs)

    def drafting_step_for(self, reqs: list[Req]) -> bool:
        """Whether the drafting step launched ahead is for exactly these requests (one for
        others is dropped)."""
        return self.drafting is not None and self.drafting.keep_if_for(reqs)
