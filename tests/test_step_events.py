"""The core's step events (engine/step_events.py): a listener hears every step of a real
run, in order, with its kind, its batch, its draft nodes and its committed tokens; a step
that raises still ends; and the instruments built on them name no private member of the
engine, so renaming one cannot silently break them."""
from __future__ import annotations

import ast
import os

import pytest

from specserve.engine.step_events import StepListener
from tests.spec_fixtures import make_tiny_directory, ngram_args, tiny_engine
from tests.test_draft_ahead import ahead_on

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8, 9] * 4, [20, 21, 22, 23] * 5]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# the instruments that hear the core through its step events
INSTRUMENTS = ("specserve/bench/run_watch.py", "lab/host_phases.py", "lab/host_replay.py", "lab/ttft_breakdown.py",
               "specserve/bench/policy_trace.py")   # ... and the adaptive policy's listener (adaptive/listener.py)


class Recorder(StepListener):
    def __init__(self):
        self.events: list[tuple] = []

    def step_began(self):
        self.events.append(("began",))

    def step_scheduled(self, batch):
        self.events.append(("scheduled", len(batch.reqs), batch.is_extend))

    def step_launched(self, kind, nodes, from_ahead):
        self.events.append(("launched", kind, nodes, from_ahead))

    def step_read(self):
        self.events.append(("read",))

    def step_committed(self, outputs):
        self.events.append(("committed", sum(len(out.new_token_ids) for out in outputs)))

    def step_ended(self):
        self.events.append(("ended",))

    def steps(self) -> list[list[tuple]]:
        """The events, cut at each step's end."""
        steps, current = [], []
        for event in self.events:
            current.append(event)
            if event == ("ended",):
                steps.append(current)
                current = []
        assert current == []
        return steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-events")
    make_tiny_directory(path)
    return path


def recorded_run(engine) -> tuple[Recorder, list[dict]]:
    recorder = Recorder()
    engine.core.events.add(recorder)
    try:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        engine.core.events.remove(recorder)
    return recorder, outputs


def ran(steps: list[list[tuple]]) -> list[list[tuple]]:
    """The steps that ran a batch (not the idle ones), each checked for the events' order."""
    running = [s for s in steps if len(s) > 2]
    for step in running:
        assert [e[0] for e in step] == ["began", "scheduled", "launched", "read", "committed", "ended"], step
    assert all(s == [("began",), ("ended",)] for s in steps if len(s) <= 2)
    return running


@pytest.mark.parametrize("speculation", [{}, ngram_args(4)], ids=["plain", "ngram"])
def test_a_listener_hears_every_step_of_a_run(model_dir, speculation):
    with tiny_engine(model_dir, **speculation) as engine:
        for launched_ahead in (False, True):
            recorder, outputs = recorded_run(ahead_on(engine) if launched_ahead else engine)
            running = ran(recorder.steps())
            launched = [step[2] for step in running]
            kinds = [kind for _, kind, _, _ in launched]
            assert kinds[0] == "prefill" and set(kinds[1:]) <= {"plain", "draft"} and len(kinds) >= 3
            # every token the run produced was committed in a step the listener heard
            assert sum(step[4][1] for step in running) == sum(len(o["output_ids"]) for o in outputs)
            assert all(nodes == 1 for _, kind, nodes, _ in launched if kind != "draft")
            scheduled = [step[1] for step in running]
            assert scheduled[0] == ("scheduled", len(PROMPTS), True)   # both prompts in one prefill
            assert all(not extend for _, _, extend in scheduled[1:])
            drafted = [nodes for _, kind, nodes, _ in launched if kind == "draft"]
            if speculation:   # the prompts repeat: the n-gram drafter proposes on most steps
                assert drafted and all(1 < nodes <= 4 for nodes in drafted)
            else:
                assert drafted == []
            ahead = sum(from_ahead for *_, from_ahead in launched)
            assert (ahead > 0) == launched_ahead, launched


def test_a_step_that_raises_still_ends(model_dir):
    with tiny_engine(model_dir) as engine:
        core, recorder = engine.core, Recorder()
        core.events.add(recorder)

        def failing_schedule():
            raise RuntimeError("scheduler down")
        core.scheduler.schedule = failing_schedule
        try:
            with pytest.raises(RuntimeError):
                core.step()
        finally:
            del core.scheduler.schedule
            core.events.remove(recorder)
        assert recorder.events == [("began",), ("ended",)]
        assert core.events.listeners == []


def private_names_read(source: str) -> set[str]:
    """Names `_x` the module reads off an object other than its own `self` (a dunder aside)."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))}


@pytest.mark.parametrize("path", INSTRUMENTS)
def test_the_instruments_read_no_private_member_of_anything_they_hear(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as source:
        assert private_names_read(source.read()) == set()


def test_the_scan_finds_a_private_member_read():
    source = "def wrap(core):\n    core._run = None\n    self._mine = 1\n    return core.plain.__class__\n"
    assert private_names_read(source) == {"_run"}
