"""DraftingStep: drafting steps launched ahead (greedy ones, and sampled ones verified on the
device: in a fused drafter's step, FusedSteps.samples_fused, or by the sampler,
Sampler.verify_on_device), with the next step of the same batch proposed and
launched between this step's commit and the bookkeeping it does not need, or, for a fused
chain and an NGRAM step with forecasts, before this step is read (draft_ahead.py says why and
what stays the same).

On a GPU the host time between reading one step's outcome and launching the next is what
a drafting step adds to its forward, so that stretch holds only: the outcome's parse, the
KV and token commit, the policy's evidence and price of this step (its next choice reads
them), the proposal, the choice of its size, and the launch. The policy's shadows of the
proposal, the drafter's observe and indexing, the text and everything after the step
returns (streaming, the next schedule) run while the GPU computes. A next step whose
proposal holds roots alone is launched ahead as a plain step instead (plain_step.py: a batch
that runs dry).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specserve.engine.commit import StepOutcome, unfinished
from specserve.engine.draft_ahead import (ChainedStep, DraftStep, ForecastStep, OutcomeCopies, launch_draft_step,
                                          launch_forecast_step)
from specserve.engine.draft_planner import Shadows
from specserve.engine.step_output import StepOutput, committed_tokens
from specserve.engine.step_parts import StepParts, StepPipeline
from specserve.engine.verify_step import drafts_with_slots
from specserve.request.forecast_record import ForecastGate, ForecastRecord
from specserve.request.req import Batch, Req
from specserve.runner.forecast_step import has_entries
from specserve.runner.tree_step import pad_node_slots
from specserve.speculative.drafter import ChainedSteps, ForecastSteps, FusedSteps, ReadsHiddenStates
from specserve.verify.tree import TreeProposal


@dataclass
class LaunchedDraft:
    step: DraftStep
    # the step ran as drafting mode runs its steps (launched or chained ahead, or on an engine
    # that launches none ahead): only such steps price its tier for good (adaptive_costs.py)
    steady: bool
    # the next step, queued before this one was read (a fused chain's, or picked from a forecast)
    chained: ChainedStep | ForecastStep | None = None


class DraftingStep(StepPipeline):
    def __init__(self, parts: StepParts):
        super().__init__(parts)
        self.copies = OutcomeCopies()   # the steps' outcomes on their way to the host
        self.forecast_gate = ForecastGate()   # which batches' next steps are forecast (request/forecast_record.py)

    def ahead_of_another_batch(self) -> Batch | None:
        """The batch of the drafting step launched ahead, where the scheduler's next batch is
        another (a request arrived): that step is read and committed first."""
        drafting = self.ahead.drafting
        step = drafting.step if drafting is not None else None
        if step is None or drafting.batch_is_next(step.reqs):
            return None
        self.ahead.settle()
        return Batch(step.reqs, is_extend=False)

    def launch(self, batch: Batch, started: float) -> LaunchedDraft:
        """The step launched ahead for this batch, or one launched now: one launched when the
        scheduler asked for it also paid for its proposal, and an episode's first a model
        drafter's catch-up of the plain stretch (H200, 1.5B EAGLE-3 at batch 4: one 7-ms
        first step priced the fused step at 4x a plain one, ended every episode at its first
        choice and, as the floor of larger buckets, kept them from drafting where chained
        steps won 1.08-1.17x): it is steady only where none is launched ahead."""
        reqs = batch.reqs
        held = self.ahead.drafting.take(reqs) if self.ahead.drafting is not None else None
        if held is not None:
            self.ahead.settle()
            self.events.launched("draft", held.num_slots, from_ahead=True)
            return LaunchedDraft(held, steady=True)
        self.ahead.settle()   # proposals read what the last step showed
        self.ahead.drop()
        proposal, slots = drafts_with_slots(self.planner, self.scheduler, reqs, True)
        try:
            step = self._launch_step(reqs, proposal, slots, started)
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them until commit
            raise
        self.events.launched("draft" if step.num_slots > 1 else "plain", step.num_slots)
        self.text.run()   # while the GPU computes
        self.planner.drafter.flush()
        return LaunchedDraft(step, steady=self.ahead.drafting is None)

    def read(self, launched: LaunchedDraft) -> StepOutcome:
        """The step's outcome (the one host sync), the next fused step queued first."""
        step = launched.step
        reqs = step.reqs
        try:
            launched.chained = self._launch_chained(reqs, step)
            outcome = step.read()
            if outcome.hidden is not None and isinstance(self.planner.drafter, ReadsHiddenStates):   # the accepted nodes'
                self.planner.drafter.observe_hidden(reqs, [r.kv_len for r in reqs],
                                            outcome.hidden.reshape(len(reqs) * step.num_slots, -1),
                                            outcome.hidden_rows(step.num_slots))
        except BaseException:
            self.scheduler.free_slots(step.slots)
            self._drop_chained(launched.chained)
            raise
        return outcome

    def commit(self, launched: LaunchedDraft, outcome: StepOutcome) -> list[StepOutput]:
        """The KV and tokens, the policy's evidence and price; then the next step of the same
        batch held or launched ahead; then what that step does not need."""
        step, chained = launched.step, launched.chained
        reqs = step.reqs
        try:
            self.committer.kv(reqs, outcome, step.node_slots, step.num_nodes)
            outputs = self.committer.verified(reqs, outcome, defer_text=True)
        except BaseException:
            self._drop_chained(chained)
            raise
        now = time.perf_counter()
        live, committed = unfinished(outputs)
        if self.planner.adaptive is not None:   # before the next step's choice, as on every path
            self.planner.show_policy(live, committed)
            self.planner.record_step(len(reqs), step.num_slots, now - step.started, committed_tokens(outputs),
                                     launched.steady, step.nodes_priced)
        self._count_cycle(launched, now)
        if chained is not None:
            next_launched, shadows = self._hold_chained(chained, outcome, outputs, now)
        else:
            next_launched, shadows = self._launch_ahead(reqs, outputs, now)
        try:
            self.planner.record_shadows(shadows)
            # after the proposal: it reads only what was flushed before it
            self.planner.drafter.observe_batch(live, committed)
            if next_launched:   # while the GPU computes the next step
                self.text.run()
                self.planner.drafter.flush()
        except BaseException:
            if next_launched:
                self.ahead.drop()   # a failed step leaves nothing ahead
            raise
        return outputs

    def _count_cycle(self, launched: LaunchedDraft, now: float) -> None:
        """A steady verify step of trees on a GPU, where the drafter forecasts: its cycle, by
        whether it was picked from a forecast or proposed after the read (the gate's
        ForecastCycles). On a CPU a launch runs the forward at once, inside the cycle of the
        step before, and the gate keeps its assumed ratio."""
        step, drafter = launched.step, self.planner.drafter
        if (launched.steady and step.tree is not None and step.num_slots > 1 and self.runner.device.type == "cuda"
                and isinstance(drafter, ForecastSteps) and drafter.forecasts(len(step.reqs))):
            self.forecast_gate.cycles.record(len(step.reqs), step.forecast, now - step.started)

    def _drafts_next(self, reqs: list[Req]) -> bool:
        """Whether the scheduler's next step is a greedy drafting step of this same batch,
        which may then be launched ahead (the policy asked last: should_draft moves its modes)."""
        drafting = self.ahead.drafting
        return (drafting is not None and drafting.batch_is_next(reqs) and self.planner.drafts_ahead(reqs)
                and self.planner.drafts_next(reqs))

    def _launch_ahead(self, reqs: list[Req], outputs: list[StepOutput], now: float) -> tuple[bool, Shadows | None]:
        """Proposes and launches the next drafting step of the same batch, if it is next;
        `now`: where its cost starts (this step's was taken at the same time: a whole cycle).
        Returns whether it launched one, and its shadows."""
        if any(out.finished for out in outputs) or not self.planner.drafter.proposes_ahead or not self._drafts_next(reqs):
            return False, None
        limits = self.planner.limits(reqs)
        # its slots and one per request to spare: the scheduler preempts nobody while it is ahead
        if self.scheduler.available_slots() < sum(limits) + len(reqs):
            return False, None
        proposal, num_nodes, shadows = self.planner.propose(reqs, limits)
        if proposal.num_slots == 1 and self._plain_runs_ahead(reqs):
            # roots alone: a plain step, and the steps after it launched ahead while the batch runs dry
            return self.ahead.plain.launch_ahead(reqs, opens_dry_stretch=True), shadows
        slots = self.scheduler.alloc_slots(sum(num_nodes))
        try:
            self.ahead.drafting.hold(self._launch_step(reqs, proposal, slots, now))
        except BaseException:
            self.scheduler.free_slots(slots)
            raise
        return True, shadows

    def _launch_step(self, reqs: list[Req], proposal: TreeProposal, slots: list[int], started: float) -> DraftStep:
        """The step launched (draft_ahead.launch_draft_step), verified as its requests ask:
        greedily, or in a fused drafter's step of a sampled kind; a sampled batch no fused step
        takes (a drafter that fuses none, a head cache full) by the sampler, on the device."""
        drafter = self.planner.drafter
        if isinstance(drafter, FusedSteps):
            kind = self.planner.fused_kind(reqs)
        else:
            kind = "greedy" if self.sampler.masked_argmax_is_enough(reqs) else None   # a grammar's: greedy_paths.py
        step = None if kind is None else launch_draft_step(self.runner, drafter, reqs, proposal, slots, started,
                                                           self.copies, kind)
        return step if step is not None else self._launch_sampled(reqs, proposal, slots, started)

    def _launch_sampled(self, reqs: list[Req], proposal: TreeProposal, slots: list[int], started: float) -> DraftStep:
        """The engine's forward of a sampled batch and the sampler's verification of it, queued
        without a host sync (Sampler.verify_on_device; the random numbers are keyed by seed and
        position, so a step launched ahead commits what it would after the read). Its accepted
        slots go into the table at the commit (a decode step's, n = 1, on the device, whose
        outcome is its tokens alone, as an argmax step's)."""
        prepared = self.sampler.prepare(proposal.trees(), reqs, proposal.draft_probs)   # sent before the forward
        out = self.runner.run_trees(reqs, proposal, slots)
        packed = self.sampler.verify_on_device(out.logits, prepared)
        n = proposal.num_slots
        launched = self.copies.launch(packed if n > 1 else packed[:, 1 + n])
        return DraftStep(reqs, proposal.num_nodes, pad_node_slots(slots, proposal.num_nodes, n), slots, launched,
                         out.hidden, started, tree=proposal, table_written=n == 1)

    def _plain_runs_ahead(self, reqs: list[Req]) -> bool:
        """Whether a step with nothing to verify may run as a plain step on the overlap schedule
        (plain_step.py), which launches its successors ahead while the drafter has nothing to
        propose: greedy requests of a batch small enough (DraftPlanner.may_run_dry), and a
        proposal the engine verifies itself (not one that reserved a fused drafter's step, which
        drafts the next step in it)."""
        drafter = self.planner.drafter
        return (self.ahead.plain is not None and self.planner.may_run_dry(len(reqs))
                and self.ahead.plain.serves(reqs)
                and not (isinstance(drafter, FusedSteps) and drafter.holds_fused_rows()))

    def _launch_chained(self, reqs: list[Req], step: DraftStep) -> ChainedStep | ForecastStep | None:
        """The next step of the same batch, queued before this one is read: its drafts and
        positions come from this step's outcome on the device (a fused chain's, or picked from
        the drafter's forecast), so the host's read, commit, proposal and launch run while the
        GPU computes it, as a plain step's do on the overlap schedule. Under the adaptive
        policy, while the batch's bucket drafts: its choice for the step is made once this one
        is committed (_hold_chained)."""
        drafter = self.planner.drafter
        if step.read_fused is None:
            return self._launch_forecast(reqs, step) if isinstance(drafter, ForecastSteps) else None
        if not self._drafts_next(reqs) or not isinstance(drafter, ChainedSteps):
            return None
        n = drafter.chain_nodes(reqs, step.launched)
        # its slots and one per request to spare: the scheduler preempts nobody while it is ahead
        if n == 0 or self.scheduler.available_slots() < len(reqs) * (n + 1):
            return None
        slots = self.scheduler.alloc_slots(len(reqs) * n)
        node_slots = np.asarray(slots, dtype=np.int64).reshape(len(reqs), n)
        try:
            chained = drafter.launch_chained(reqs, node_slots)
        except BaseException:
            self.scheduler.free_slots(slots)
            raise
        if chained is None:   # no room in the drafter's cache
            self.scheduler.free_slots(slots)
            return None
        return ChainedStep(reqs, chained[0], node_slots, chained[1])

    def _launch_forecast(self, reqs: list[Req], step: DraftStep) -> ForecastStep | None:
        """The next verify step of the same batch, its trees picked on the device from the
        drafter's forecast by this step's outcome (runner/forecast_step.py): greedy requests
        without a grammar (whose outcome the host may still move), no tensor parallelism
        (workers replay from host-built inputs), room for both steps' nodes in every request's
        context and table row; and a batch whose requests stand to gain from it
        (request/forecast_record.py). Where none is queued, the requests' records hear that
        their next step is proposed after the read."""
        drafter = self.planner.drafter
        if (step.num_slots == 1 or step.tree is None or self.runner.tp is not None
                or not drafter.forecasts(len(reqs)) or not self.sampler.argmax_is_enough(reqs)):
            return None
        records = [req.forecast for req in reqs]
        forecast = self._forecast_table(reqs, step, records)
        if forecast is None:
            for record in records:
                record.skip()
            return None
        table, n, step_ratio = forecast
        if step.hidden is not None:   # a graph's outputs, which the forecast step's replay overwrites before they are read
            step.hidden = step.hidden.clone()
        slots = self.scheduler.alloc_slots(len(reqs) * n)
        try:
            return launch_forecast_step(self.runner, step, table, slots, self.copies, self.forecast_gate, step_ratio)
        except BaseException:
            self.scheduler.free_slots(slots)
            raise

    def _forecast_table(self, reqs: list[Req], step: DraftStep,
                        records: list[ForecastRecord]) -> tuple[np.ndarray, int, float] | None:
        """The forecast the step after `step` picks from, its width and the gate's r; None where
        no forecast step may follow: no room for both steps' nodes, another batch next, a gate
        that finds misses would cost more than the read they hide, or no entry in the table."""
        n, limit = self._forecast_width(step), self.planner.num_draft_tokens
        room = min(self.planner.context_length, self.runner.pool.req_to_token.shape[1])
        # its slots and one per request to spare: the scheduler preempts nobody while it is ahead
        if (any(r.kv_len + step.num_slots + n >= room for r in reqs)
                or self.scheduler.available_slots() < len(reqs) * (n + 1)):
            return None
        if not self._drafts_next(reqs):
            return None
        wanted, step_ratio = self.forecast_gate.wants(records, len(reqs))
        if not wanted:
            return None
        table = self.planner.drafter.forecast(reqs, step.tree, limit)   # trees as large as a proposal's: the policy's shadows
        if not has_entries(table):   # whatever N's outcome, nothing to verify: the step after the read decides
            return None
        return table, n, step_ratio

    def _forecast_width(self, step: DraftStep) -> int:
        """Nodes a request of the forecast step after `step`: the tier the policy chose given
        the trees `step` was picked from whole (so a forecast episode's width follows its
        evidence, up and down), else `step`'s own width; without a policy, the pinned size."""
        limit = self.planner.num_draft_tokens
        width = step.next_width or (step.num_slots if self.planner.adaptive is not None else limit)
        return max(2, min(width, limit))

    def _hold_chained(self, chained: ChainedStep | ForecastStep, before: StepOutcome, outputs: list[StepOutput],
                      now: float) -> tuple[bool, Shadows | None]:
        """The chained step, once the step before is committed (`before`: its outcome): held
        as the step ahead for the requests that go on (the others' rows cut, their slots
        freed), priced from `now` as a step launched ahead is, and chosen for by the policy
        (DraftPlanner.choose_chained). Returns what _launch_ahead does; nothing held if every
        request ended."""
        ended = [i for i, out in enumerate(outputs) if out.finished]
        if len(ended) == len(outputs):
            chained.free(self.scheduler, self.planner.drafter, ended)
            return False, None
        live = [i for i, out in enumerate(outputs) if not out.finished]
        step, proposal, num_nodes, keys = chained.hold(self.scheduler, self.planner.drafter, before, live, now)
        self.ahead.drafting.hold(step)
        shadows, tier = self.planner.choose_chained(step.reqs, proposal, num_nodes, keys)
        if isinstance(chained, ForecastStep) and tier is not None and tier > 1:
            step.next_width = tier
        return True, shadows

    def _drop_chained(self, chained: ChainedStep | ForecastStep | None) -> None:
        if chained is not None:
            chained.free(self.scheduler, self.planner.drafter, list(range(len(chained.reqs))))
