"""EngineCore: one step is schedule -> (draft) -> forward -> verify -> commit.

Nothing else talks to the model. Each kind of step has its pipeline, which launches it
(drafts and forward), reads it (verification: the step's wait for the device) and commits
it: a prefill (prefill_step.py), a plain greedy step on the overlap schedule, the next one
launched before this one is read (plain_step.py), a greedy drafting step, the next one
launched before this one's bookkeeping (drafting_step.py), and every other decode step,
launched when asked for and read at once (verify_step.py). A decode step is a verify step
whose draft trees hold only their root, so plain decoding and every speculative algorithm
share one verification.
"""
from __future__ import annotations

import logging
import time

from specserve.engine.commit import DeferredText
from specserve.engine.committer import Committer
from specserve.engine.draft_ahead import DraftAhead
from specserve.engine.draft_planner import DraftPlanner
from specserve.engine.drafting_step import DraftingStep
from specserve.engine.overlap import OverlapSchedule, StepAhead
from specserve.engine.plain_step import PlainStep
from specserve.engine.prefill_step import PrefillStep
from specserve.engine.scheduler import Scheduler
from specserve.engine.stats import StepLogger
from specserve.engine.step_events import StepEvents
from specserve.engine.step_output import StepOutput
from specserve.engine.step_parts import StepParts, StepPipeline
from specserve.engine.steps_ahead import StepsAhead
from specserve.engine.verify_step import VerifyStep
from specserve.request.req import Batch, Req, ReqState
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.sampler import Sampler
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.drafter import Drafter

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "StepOutput"]


class PartAttribute:
    """An attribute of the core that one of its parts keeps: read and set there."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, core, owner=None):
        return self if core is None else getattr(getattr(core, self.part), self.name)

    def __set__(self, core, value) -> None:
        setattr(getattr(core, self.part), self.name, value)


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler,
                 drafter: Drafter | None, num_draft_tokens: int, log_interval_s: float = 10.0,
                 adaptive: AdaptiveDraftLength | None = None, overlap: bool = False):
        self.runner, self.scheduler, self.sampler = runner, scheduler, sampler
        self.planner = DraftPlanner(drafter, adaptive, sampler, num_draft_tokens, runner.context_length)
        # plain steps run one step ahead (always without a drafter, and with one while the
        # adaptive draft length says plain decoding wins); greedy drafting steps are launched
        # before the last one's bookkeeping
        self.ahead = StepsAhead(OverlapSchedule(runner, scheduler, sampler) if overlap else None,
                                DraftAhead(scheduler) if overlap else None)
        self.text = DeferredText()   # detokenizing, done while the GPU runs the next step
        self.requests: dict[str, Req] = {}
        self.committer = Committer(scheduler, self.planner, self.text,
                                   StepLogger(log_interval_s, speculative=drafter is not None), self.requests)
        self.events = StepEvents()   # profilers add their listeners here
        parts = StepParts(runner, scheduler, sampler, self.planner, self.committer, self.text, self.ahead, self.events)
        self.prefill, self.plain, self.drafting = PrefillStep(parts), PlainStep(parts), DraftingStep(parts)
        self.verify = VerifyStep(parts, drafts=True)
        self.verify_plain = VerifyStep(parts, drafts=False)   # plain steps where none is launched ahead
        self.last_batch_reqs: list[Req] = []   # the requests of the step in flight, failed together if it raises
        scheduler.preempt_listeners.append(self._preempted)
        scheduler.parked.listeners.append(self.planner.release)   # a finished request released late

    # --- public surface ---
    def add_request(self, req: Req) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if req.max_new_tokens == 0:
            req.state = ReqState.FINISHED
            req.finish_reason = {"type": "length", "length": 0}
            req.finish_time = time.perf_counter()
            return
        self.requests[req.rid] = req
        self.scheduler.add(req)
        if self.drafter is not None:
            self.drafter.add_prompt(req)

    def abort(self, rid: str) -> Req | None:
        req = self.requests.pop(rid, None)
        if req is None or req.finished:
            return None
        self.ahead.settle()
        self.ahead.drop()  # a step launched ahead may hold a slot for this request
        self.text.drain(req)
        self.scheduler.abort(req)
        req.state = ReqState.FINISHED
        req.finish_reason = {"type": "abort", "message": "aborted"}
        req.finish_time = time.perf_counter()
        self.planner.release(req)
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One step: schedule -> (draft) -> forward -> verify -> commit, by the pipeline of its kind."""
        self.events.began()
        try:
            batch, kept = self._schedule()
            return self._idle() if batch is None else self._run(batch, kept)
        finally:
            self.events.ended()

    def _schedule(self) -> tuple[Batch | None, StepAhead | None]:
        """The step's batch: that of the drafting step launched ahead where the scheduler's
        next batch is another (a request arrived: that step is read and committed first),
        else the scheduler's; and the plain step launched ahead that a prefill keeps (its
        tokens still count, read once the prefill is launched). Other steps ahead go before a prefill."""
        retiring = self.drafting.ahead_of_another_batch()
        if retiring is not None:
            return retiring, None
        batch = self.scheduler.schedule()
        kept = self.plain.keep_through(batch)
        if batch is None or batch.is_extend:
            self.ahead.drop()
        return batch, kept

    def _run(self, batch: Batch, kept: StepAhead | None) -> list[StepOutput]:
        """The batch's step, by the pipeline of its kind; a plain step a prefill kept is read
        and committed while the GPU runs the prefill (its outputs go first)."""
        self.events.scheduled(batch)
        self.last_batch_reqs = batch.reqs if kept is None else batch.reqs + kept.reqs
        kept_outputs: list[StepOutput] = []
        try:
            started = time.perf_counter()   # a decode step's price counts from here
            pipeline = self.pipeline_for(batch)
            launched = pipeline.launch(batch, started)     # draft + forward (or the step launched ahead)
            if kept is not None:
                # its GPU work came before the prefill's: reading it waits for that alone, and
                # its commit (a grammar's checks: ~0.8 ms at 64 rows on an H200's host) is host
                # work the prefill hides instead of time the GPU idles after it. commit_kept
                # releases it itself if its read fails, so it is no longer ours to release.
                step_ahead, kept = kept, None
                kept_outputs = self.plain.commit_kept(step_ahead)
            outcome = pipeline.read(launched)              # verify: the step's one wait for the device
            self.events.read()
            outputs = pipeline.commit(launched, outcome)   # commit (the next step launched before the rest)
        except BaseException:
            self.plain.release(kept)
            raise
        self.events.committed(outputs)
        self.stats.maybe_log(self.scheduler)
        return kept_outputs + outputs

    def _idle(self) -> list[StepOutput]:
        self.ahead.settle()   # a prefill runs it after its launch, a decode step where its pipeline says
        self.text.run()
        return []

    def pipeline_for(self, batch: Batch) -> StepPipeline:
        """The pipeline of the batch's kind of step."""
        reqs = batch.reqs
        if batch.is_extend:
            return self.prefill
        if self.ahead.drafting_step_for(reqs):
            return self.drafting
        draft = self.planner.drafts(reqs, self.ahead.plain_step_for(reqs))
        if not draft and self.ahead.plain is not None and self.ahead.plain.serves(reqs):
            return self.plain
        if draft and self.planner.drafts_ahead(reqs):
            return self.drafting
        return self.verify if draft else self.verify_plain

    def _preempted(self, req: Req) -> None:
        self.ahead.settle()   # the drafter saw the request's last tokens first
        if self.drafter is not None:
            self.drafter.preempted(req)   # e.g. a draft model's KV, rebuilt when the request resumes

    # what the engine, its benchmarks and tests read or swap (a warm-up's scratch drafter), kept by the parts
    drafter = PartAttribute("planner", "drafter")
    adaptive = PartAttribute("planner", "adaptive")
    num_draft_tokens = PartAttribute("planner", "num_draft_tokens")
    stats = PartAttribute("committer", "stats")
    spec_counters = PartAttribute("committer", "spec_counters")
    overlap = PartAttribute("ahead", "plain")
    draft_ahead = PartAttribute("ahead", "drafting")

