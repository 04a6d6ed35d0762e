"""StepParts: what every step pipeline works with, built once by the core; StepPipeline: the
base of the pipelines (engine/*_step.py), one per kind of step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.engine.commit import DeferredText
from specserve.engine.committer import Committer
from specserve.engine.draft_planner import DraftPlanner
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_events import StepEvents
from specserve.engine.step_output import StepOutput
from specserve.engine.steps_ahead import StepsAhead
from specserve.request.req import Batch
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.sampler import Sampler


@dataclass
class StepParts:
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler
    planner: DraftPlanner      # the drafter, the adaptive policy and the draft sizes
    committer: Committer       # KV, tokens and statistics of a step's outcome
    text: DeferredText         # detokenizing, done while the GPU runs the next step
    ahead: StepsAhead          # the steps launched ahead, and a plain step's put-off bookkeeping
    events: StepEvents         # what profilers hear of each step


class StepPipeline:
    """One kind of step: launched, read, committed (EngineCore._run)."""

    def __init__(self, parts: StepParts):
        self.runner, self.scheduler, self.sampler = parts.runner, parts.scheduler, parts.sampler
        self.planner, self.committer, self.text = parts.planner, parts.committer, parts.text
        self.ahead, self.events = parts.ahead, parts.events

    def launch(self, batch: Batch, started: float) -> Any:
        """The drafts and the forward, or the step launched ahead for the batch."""
        raise NotImplementedError

    def read(self, launched: Any) -> Any:
        """The verification: what each request commits (the step's one wait for the device)."""
        raise NotImplementedError

    def commit(self, launched: Any, outcome: Any) -> list[StepOutput]:
        """KV, tokens, the drafter and the policy; where it can, the next step launched first."""
        raise NotImplementedError
