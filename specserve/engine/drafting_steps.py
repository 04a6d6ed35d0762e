"""The engine core's greedy drafting steps (a mixin of EngineCore, core.py): propose, launch,
read and commit, with the next step of the same batch proposed and launched between this
step's commit and the bookkeeping that step does not need (draft_ahead.py says why and
what stays the same).

On a GPU the host time between reading one step's outcome and launching the next is what
a drafting step adds to its forward, so that stretch holds only: the outcome's parse, the
KV and token commit, the policy's evidence and price of this step (its next choice reads
them), the proposal, the choice of its size, and the launch. The policy's shadows of the
proposal, the drafter's observe and indexing, the text and everything after the step
returns (streaming, the next schedule) run while the GPU computes.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.engine.commit import unfinished
from specserve.engine.draft_ahead import ChainedStep, DraftStep, launch_draft_step
from specserve.request.req import Req
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.engine.step_output import StepOutput


class DraftingSteps:
    """EngineCore's drafting-step methods (they read the core's runner, scheduler, sampler,
    drafter, adaptive policy, text, draft_ahead and outcome_copies)."""

    def _drafts_greedily(self, reqs: list[Req]) -> bool:
        """Whether a drafting step of these requests takes the greedy path of draft_ahead.py."""
        return self.drafter.proposes_ahead and self.sampler.argmax_is_enough(reqs)

    def _draft_limits(self, reqs: list[Req]) -> list[int]:
        """Never draft past max_new_tokens or the context: those nodes could not be committed."""
        return [max(1, min(self.num_draft_tokens, r.max_new_tokens - len(r.output_ids),
                           self.runner.context_length - r.kv_len)) for r in reqs]

    def _propose(self, reqs: list[Req], limits: list[int] | None = None
                 ) -> tuple[TreeProposal, list[int], Callable[[], None]]:
        """The proposal cut to the policy's choice of size, and the recording of the full
        proposals as the policy's shadows (nothing without a policy), for the caller to run:
        no choice reads them before the step's tokens are committed, so it may wait until
        the step is launched."""
        proposal, num_nodes = self.drafter.propose(reqs, limits if limits is not None else self._draft_limits(reqs))
        if self.adaptive is None:
            return proposal, num_nodes, record_nothing
        rids, keys = [r.rid for r in reqs], self.drafter.proposal_keys()
        record = functools.partial(self.adaptive.record_proposals, rids, proposal, num_nodes, keys)
        nodes = self.adaptive.choose_nodes(rids, num_nodes, keys)
        return proposal.cut(nodes), nodes, record

    def _launch_draft(self, reqs: list[Req], proposal: TreeProposal, slots: list[int], started: float) -> DraftStep:
        """Launches a drafting step the scheduler asked for; while the GPU computes, the host
        detokenizes the last step's tokens and hands the drafter's indexing to its writer."""
        try:
            step = launch_draft_step(self.runner, self.drafter, reqs, proposal, slots, started, self.outcome_copies)
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them until commit
            raise
        self.text.run()
        self.drafter.flush()
        return step

    def _finish_draft_step(self, reqs: list[Req], step: DraftStep, steady: bool) -> list[StepOutput]:
        """Reads and commits a greedy drafting step; when the same batch drafts next, that step
        is launched before the bookkeeping it does not need, or, for a fused chain, before
        this step is read (_launch_chained). `steady`: the step ran as drafting mode runs
        its steps (launched or chained ahead, or on an engine that launches none ahead);
        only such steps price its tier for good (adaptive/costs.py): one launched when the
        scheduler asked for it also paid for its proposal, and an episode's first a model
        drafter's catch-up of the plain stretch (H200, 1.5B EAGLE-3 at batch 4: one 7-ms
        first step priced the fused step at 4x a plain one, ended every episode at its
        first choice and, as the floor of larger buckets, kept them from drafting where
        chained steps won 1.08-1.17x)."""
        chained = self._launch_chained(reqs, step)
        try:
            outcome = step.read()
            if outcome.hidden is not None:   # the states of the accepted nodes
                self.drafter.observe_hidden(reqs, [r.kv_len for r in reqs],
                                            outcome.hidden.reshape(len(reqs) * step.num_slots, -1),
                                            outcome.hidden_rows(step.num_slots))
        except BaseException:
            self.scheduler.free_slots(step.slots)
            self._drop_chained(chained)
            raise
        try:
            self._commit_kv(reqs, outcome, step.node_slots, step.num_nodes)
            outputs = self._commit_verified(reqs, outcome, defer_text=True)
        except BaseException:
            self._drop_chained(chained)
            raise
        now = time.perf_counter()
        adaptive = self.adaptive
        live, committed = unfinished(outputs)
        if adaptive is not None:   # before the next step's choice, as on every path
            adaptive.observe_batch([req.rid for req in live], committed)
            adaptive.record_step(len(reqs), step.num_slots, now - step.started,
                                 sum(len(out.new_token_ids) for out in outputs), steady, int(step.num_nodes.sum()))
        if chained is not None:
            record_shadows = self._hold_chained(chained, outputs, now)
        else:
            record_shadows = self._launch_ahead(reqs, outputs, now)
        launched = record_shadows is not None
        try:
            if launched:
                record_shadows()
            # after the proposal: it reads only what was flushed before it
            self.drafter.observe_batch(live, committed)
            if launched:   # while the GPU computes the next step
                self.text.run()
                self.drafter.flush()
        except BaseException:
            if launched:
                self.draft_ahead.drop()   # a failed step leaves nothing ahead
            raise
        return outputs

    def _drafts_next_greedily(self, reqs: list[Req]) -> bool:
        """Whether the scheduler's next step is a greedy drafting step of this same batch,
        which may then be launched ahead (the policy asked last: should_draft moves its modes)."""
        return (self.draft_ahead is not None and self.draft_ahead.batch_is_next(reqs)
                and self.sampler.argmax_is_enough(reqs)
                and (self.adaptive is None or self.adaptive.should_draft(len(reqs))))

    def _launch_ahead(self, reqs: list[Req], outputs: list[StepOutput], now: float) -> Callable[[], None] | None:
        """Proposes and launches the next drafting step of the same batch, if it is next;
        `now`: where its cost starts (this step's was taken at the same time: a whole cycle).
        Returns the recording of its shadows (see _propose), None if nothing was launched."""
        if (any(out.finished for out in outputs) or not self.drafter.proposes_ahead
                or not self._drafts_next_greedily(reqs)):
            return None
        limits = self._draft_limits(reqs)
        # its slots and one per request to spare: the scheduler preempts nobody while it is ahead
        if self.scheduler.available_slots() < sum(limits) + len(reqs):
            return None
        proposal, num_nodes, record_shadows = self._propose(reqs, limits)
        slots = self.scheduler.alloc_slots(sum(num_nodes))
        try:
            self.draft_ahead.hold(launch_draft_step(self.runner, self.drafter, reqs, proposal, slots, now,
                                                    self.outcome_copies))
        except BaseException:
            self.scheduler.free_slots(slots)
            raise
        return record_shadows

    def _launch_chained(self, reqs: list[Req], step: DraftStep) -> ChainedStep | None:
        """The next fused step of the same batch, queued before this one is read: its drafts
        and positions come from this step's outcome on the device, so the host's read,
        commit, proposal and launch run while the GPU computes it, as a plain step's do on
        the overlap schedule. Under the adaptive policy, while the batch's bucket drafts: its
        choice for the step is made once this one is committed (_hold_chained)."""
        if step.read_fused is None or not self._drafts_next_greedily(reqs):
            return None
        n = self.drafter.chain_nodes(reqs, step.launched)
        # its slots and one per request to spare: the scheduler preempts nobody while it is ahead
        if n == 0 or self.scheduler.available_slots() < len(reqs) * (n + 1):
            return None
        slots = self.scheduler.alloc_slots(len(reqs) * n)
        node_slots = np.asarray(slots, dtype=np.int64).reshape(len(reqs), n)
        try:
            chained = self.drafter.launch_chained(reqs, node_slots)
        except BaseException:
            self.scheduler.free_slots(slots)
            raise
        if chained is None:   # no room in the drafter's cache
            self.scheduler.free_slots(slots)
            return None
        return ChainedStep(reqs, chained[0], node_slots, chained[1])

    def _hold_chained(self, chained: ChainedStep, outputs: list[StepOutput], now: float
                      ) -> Callable[[], None] | None:
        """The chained step, once the step before is committed: held as the step ahead for
        the requests that go on (the others' rows cut, their slots freed), priced from `now`
        as a step launched ahead is. The adaptive policy makes its choice for it as for a
        proposal (its evidence and episode bookkeeping; the step verifies the whole chain
        whatever the tier, which costs a fused step the same, and a choice of plain decoding
        applies from the next step). Returns what _launch_ahead would (the shadows'
        recording), None if every request ended."""
        ended = [i for i, out in enumerate(outputs) if out.finished]
        if ended:
            chained.free(self.scheduler, self.drafter, ended)
        if len(ended) == len(outputs):
            return None
        step = chained.held(self.drafter, [i for i, out in enumerate(outputs) if not out.finished], now)
        self.draft_ahead.hold(step)
        if self.adaptive is None:
            return record_nothing
        proposal, num_nodes = self.drafter.chained_proposal(step.reqs)
        rids, keys = [r.rid for r in step.reqs], self.drafter.proposal_keys()
        self.adaptive.choose(rids, num_nodes, keys)
        return functools.partial(self.adaptive.record_proposals, rids, proposal, num_nodes, keys)

    def _drop_chained(self, chained: ChainedStep | None) -> None:
        if chained is not None:
            chained.free(self.scheduler, self.drafter, list(range(len(chained.reqs))))

    def _retire_ahead(self, reqs: list[Req]) -> list[StepOutput]:
        """The drafting step launched ahead, read and committed before the scheduler picks
        another batch (a request arrived)."""
        self.last_batch_reqs = reqs
        outputs = self._finish_draft_step(reqs, self.draft_ahead.take(reqs), steady=True)
        self.stats.maybe_log(self.scheduler)
        return outputs


def record_nothing() -> None:
    """The shadows' recording without an adaptive policy."""
