"""A step launched ahead whose batch lost requests before it was read (overlap.py): the rows
of requests a stop token ended are cut (their slots freed, their tokens never read), the
others' tokens, hidden-state rows and next roots are read through the launch's rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.engine.overlap import OverlapSchedule, StepAhead
from specserve.runner.model_runner import InFlight


def launched_step(finished: list[bool]) -> tuple[list, StepAhead]:
    reqs = [SimpleNamespace(finished=f, kv_len=5 + i, grammar=None, params=SimpleNamespace(greedy=True))
            for i, f in enumerate(finished)]
    argmax = torch.tensor([70 + i for i in range(len(reqs))])
    hidden = torch.arange(2.0 * len(reqs)).reshape(len(reqs), 2)
    return reqs, StepAhead(list(reqs), [10 + i for i in range(len(reqs))], InFlight(argmax, argmax, None), hidden)


def schedule_with(step: StepAhead, freed: list[int]) -> OverlapSchedule:
    schedule = OverlapSchedule(runner=None, scheduler=SimpleNamespace(free_slots=freed.extend))
    schedule.ahead = step
    return schedule


def test_rows_of_ended_requests_are_cut_when_the_step_is_read():
    reqs, step = launched_step([False, True, False, True])
    freed = []
    read = schedule_with(step, freed).current_step([reqs[0], reqs[2]], lambda: pytest.fail("read ahead, not relaunched"))
    assert read is step and step.reqs == [reqs[0], reqs[2]]
    assert freed == [11, 13] and step.slots == [10, 12]
    assert step.tokens() == [70, 72]
    assert step.hidden_rows() == [[0], [2]]
    assert step.roots([1]).tolist() == [72] and step.roots([0, 1]).tolist() == [70, 72]


def test_an_uncut_step_hands_its_argmax_on_as_is():
    reqs, step = launched_step([False, False, False])
    assert step.roots([0, 1, 2]) is step.launched.device   # no gather where every row goes on
    assert step.roots([0, 2]).tolist() == [70, 72]          # a request its length ends: left out
    assert step.tokens() == [70, 71, 72] and step.hidden_rows() == [[0], [1], [2]]


def test_a_cut_step_that_no_longer_matches_the_batch_is_dropped_whole():
    """Another change to the batch (here a request left it without ending: preempted, say):
    the step's remaining slots are freed too and a new step is launched for the batch."""
    reqs, step = launched_step([False, True, False])
    freed = []
    schedule = schedule_with(step, freed)
    schedule.scheduler.alloc_slots = lambda n: [20 + i for i in range(n)]
    schedule.runner = SimpleNamespace(launch_greedy_decode=lambda reqs, kv_lens, slots, roots: (
        InFlight(torch.tensor(roots), torch.tensor(roots), None), None, None))
    relaunched = schedule.current_step([reqs[2]], lambda: [99])
    assert sorted(freed) == [10, 11, 12]
    assert relaunched is not step and relaunched.slots == [20] and relaunched.tokens() == [99]
