"""VerifyStep: a decode step launched when the scheduler asks for it and read before it returns.

It serves every decode step no step launched ahead serves: steps that sample (penalties,
logprobs, temperature: the sampler reads the logits), drafting steps of drafters that do
not propose ahead, a fused drafter's verify step (NAIVE_EAGLE, MTP: the target's forward,
verification and the next draft in one device function), and plain steps of an engine
that launches none ahead (`drafts=False`; they may probe). Its drafts and slots come from
`drafts_with_slots`, which greedy drafting steps (drafting_step.py) share.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specserve.engine.commit import StepOutcome
from specserve.engine.draft_planner import DraftPlanner
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_output import StepOutput, committed_tokens
from specserve.engine.step_parts import StepParts, StepPipeline
from specserve.request.req import Batch, Req
from specserve.runner.model_runner import InFlight
from specserve.runner.tree_step import GreedyOutcome, pad_node_slots
from specserve.sampling.sampler import SampledStep
from specserve.speculative.adaptive.draft_cuts import fit_to_free_slots
from specserve.speculative.drafter import FusedSteps, ReadsHiddenStates
from specserve.verify.tree import TreeProposal


def drafts_with_slots(planner: DraftPlanner, scheduler: Scheduler, reqs: list[Req],
                      draft: bool) -> tuple[TreeProposal, list[int]]:
    """The step's draft trees (root only unless it drafts; a grammar's forbidden drafts cut,
    forced ones added) and their KV slots, request after request. The cache fits one token
    a request (the scheduler made sure), not every draft: drafts that do not fit are cut."""
    if draft:
        proposal, num_nodes, shadows = planner.propose(reqs)
        planner.record_shadows(shadows)
    else:
        proposal, num_nodes = TreeProposal.root_only([r.last_token for r in reqs]), [1] * len(reqs)
    free = scheduler.available_slots()
    if sum(num_nodes) > free:
        num_nodes = fit_to_free_slots(list(num_nodes), free)
        proposal = proposal.cut(num_nodes)
    return proposal, scheduler.alloc_slots(sum(num_nodes))


@dataclass
class LaunchedVerify:
    reqs: list[Req]
    proposal: TreeProposal
    slots: list[int]                        # the nodes' KV slots: no request's until commit
    started: float                          # the step's price counts from here
    probing: bool                           # a plain step that probes after its commit
    fused: SampledStep | None = None        # a fused drafter's step, run and read already
    hidden: Any = None                      # (bs, n, features) the nodes' states, when the runner keeps them
    greedy: InFlight | None = None          # the device's greedy outcome on its way to the host
    logits: Any = None                      # (bs, n, vocab) for the sampler
    host_trees: Any = None
    prepared: Any = None                    # the sampler's tensors, sent before the forward


class VerifyStep(StepPipeline):
    def __init__(self, parts: StepParts, drafts: bool):
        super().__init__(parts)
        self.drafts = drafts   # False: plain steps of an engine that launches none ahead

    def launch(self, batch: Batch, started: float) -> LaunchedVerify:
        """The drafts (a plain step's probe decided) and the forward. Greedy trees are
        verified on the device, which also writes the accepted slots into the KV table: one
        copy of the outcome comes back. A fused drafter runs and reads its own step. While
        the GPU computes, the host detokenizes the previous step's tokens and hands the
        drafter's deferred indexing to its writer (plain steps that do not probe leave it
        to the next probe)."""
        reqs = batch.reqs
        self.ahead.settle()   # proposals, probes and prices below read what the last step showed
        self.ahead.drop()
        probing = not self.drafts and self.planner.probe_due(reqs)
        proposal, slots = drafts_with_slots(self.planner, self.scheduler, reqs, self.drafts)
        step = LaunchedVerify(reqs, proposal, slots, started, probing)
        try:
            self._forward(step)
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them until commit
            raise
        self.events.launched("draft" if proposal.num_slots > 1 else "plain", proposal.num_slots)
        return step

    def _forward(self, step: LaunchedVerify) -> None:
        reqs, proposal = step.reqs, step.proposal
        drafter = self.planner.drafter
        if self.drafts and isinstance(drafter, FusedSteps):   # a plain step's never fuses: its next step may be plain too
            step.fused = drafter.verify_fused(reqs, proposal, step.slots, self.sampler, self.text.run)
            if step.fused is not None:   # the text ran while the GPU computed the step
                return
        greedy = proposal.num_slots > 1 and self.sampler.argmax_is_enough(reqs)
        if not greedy:  # the sampler's tensors are sent before the forward: a copy after it would wait for it
            step.host_trees = proposal.trees()
            step.prepared = self.sampler.prepare(step.host_trees, reqs, proposal.draft_probs)
        out = self.runner.run_trees(reqs, proposal, step.slots)
        step.hidden, step.logits = out.hidden, out.logits
        step.greedy = InFlight.launch(out.outcome) if greedy else None
        self.text.run()
        if self.planner.drafter is not None and (self.drafts or step.probing):
            self.planner.drafter.flush()  # indexed in the background while the GPU computes the step

    def read(self, step: LaunchedVerify) -> StepOutcome:
        """What each request commits: its accepted nodes and tokens."""
        try:
            return self._outcome(step)
        except BaseException:
            self.scheduler.free_slots(step.slots)
            raise

    def _outcome(self, step: LaunchedVerify) -> StepOutcome:
        n = step.proposal.num_slots
        if step.fused is not None:
            return StepOutcome.from_sampled(step.fused, n, table_written=True)
        if step.greedy is not None:
            parsed = GreedyOutcome.parse(step.greedy.wait())
            return StepOutcome(parsed.tokens, parsed.accepted, parsed.accept_lens, True, step.hidden)
        sampled = self.sampler.sample(step.logits, step.host_trees, step.reqs, step.prepared)
        # a decode step (n = 1) wrote its one slot on the device (tree_step.write_decode_slots)
        return StepOutcome.from_sampled(sampled, n, table_written=n == 1, hidden=step.hidden)

    def commit(self, step: LaunchedVerify, outcome: StepOutcome) -> list[StepOutput]:
        """The accepted nodes' states to the drafter, the KV and the tokens committed and
        shown; under the adaptive policy the probe and the step's price."""
        reqs, proposal = step.reqs, step.proposal
        if outcome.hidden is not None and isinstance(self.planner.drafter, ReadsHiddenStates):   # the states of the accepted nodes
            self.planner.drafter.observe_hidden(reqs, [r.kv_len for r in reqs],
                                        outcome.hidden.reshape(len(reqs) * proposal.num_slots, -1),
                                        outcome.hidden_rows(proposal.num_slots))
        self.committer.kv(reqs, outcome, pad_node_slots(step.slots, proposal.num_nodes, proposal.num_slots),
                          proposal.num_nodes)
        outputs = self.planner.observe(self.committer.verified(reqs, outcome, defer_text=True))
        if self.planner.adaptive is not None:
            if step.probing:
                self.planner.probe(reqs)  # its host time is part of what plain steps cost
            # a plain step here prices plain decoding only where plain mode runs its steps so too
            # (drafting steps skip the check: `or` stops at them)
            steady = proposal.num_slots > 1 or not (self.planner.rare_probe(reqs, step.probing) or (
                self.ahead.plain is not None and self.ahead.plain.serves(reqs)))
            self.planner.record_step(len(reqs), proposal.num_slots, time.perf_counter() - step.started,
                                     committed_tokens(outputs), steady, int(proposal.num_nodes.sum()))
        return outputs
