"""StepParts: what every step pipeline works with, built once by the core; StepPipeline: the
base of the pipelines (engine/*_step.py), one per kind of step; KeptStep: a decode step
launched ahead that a prefill keeps."""
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
from specserve.request.req import Batch, Req
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


@dataclass
class KeptStep:
    """A decode step launched ahead that a prefill came after (a request arrived): its tokens
    still count, so the pipeline that launched it reads and commits it once the prefill is
    launched behind it (its GPU work came first), where before the prefill waited for its
    read and commit (EngineCore._run)."""
    pipeline: Any   # PlainStep or DraftingStep: commit_kept, release_kept
    step: Any       # its StepAhead or DraftStep

    @property
    def reqs(self) -> list[Req]:
        return self.step.reqs

    def commit(self) -> list[StepOutput]:
        """Read and committed; released by the pipeline itself if its read fails."""
        return self.pipeline.commit_kept(self.step)

    def release(self) -> None:
        """Its slots freed (no request holds them before its commit)."""
        self.pipeline.release_kept(self.step)
