"""DraftPlanner: the step pipelines' one seam to the drafter's proposals and the adaptive
draft-length policy (speculative/adaptive.py).

It answers what a step needs to know before it launches (does it draft, how many nodes,
which proposal), records what the policy learns from each step (its proposals as shadows,
its price, the tokens it committed) and runs the probes plain steps make: a plain step's
look at whether drafting would pay now. Without a drafter it answers "plain" throughout;
without a policy every step drafts the full proposal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specserve.engine.commit import unfinished
from specserve.engine.step_output import StepOutput
from specserve.grammar.drafts import constrain_proposal
from specserve.request.req import Req
from specserve.sampling.sampler import Sampler
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.drafter import Drafter, FusedSteps, hints
from specserve.verify.tree import TreeProposal


# The largest batch whose steps with nothing to draft run as plain steps launched ahead (runs_dry).
# H200, 1.5B, NGRAM with default flags, against 98f114d (which verified roots alone): at batch 1,
# code edits with types +8% (every round above every round before), the rest within their spread;
# at batch 8, the repeated turn's throughput 0.78-0.90 of 98f114d's in each of five comparisons over
# two days. With the limit at 1, that turn at 8 ran 8541-10182 tok/s against 6802-8445 (one lease).
DRY_STRETCH_MAX_BATCH = 1


@dataclass
class Shadows:
    """A step's full proposals, recorded as the policy's shadows once the step is launched
    (no choice reads them before the step's tokens are committed)."""
    rids: list[str]
    proposal: TreeProposal
    num_nodes: list[int]
    keys: list[int] | None


class DraftPlanner:
    def __init__(self, drafter: Drafter | None, adaptive: AdaptiveDraftLength | None, sampler: Sampler,
                 num_draft_tokens: int, context_length: int):
        self.drafter = drafter
        self.adaptive = adaptive if drafter is not None else None   # None: always verify the full draft
        self.sampler = sampler
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 1
        self.context_length = context_length

    # --- before a step launches ---
    def limits(self, reqs: list[Req]) -> list[int]:
        """Never draft past max_new_tokens or the context: those nodes could not be committed."""
        return [max(1, min(self.num_draft_tokens, r.max_new_tokens - len(r.output_ids),
                           self.context_length - r.kv_len)) for r in reqs]

    def drafts(self, reqs: list[Req], plain_step_ahead: bool) -> bool:
        """Whether this decode step drafts. The choice may read the policy one plain step
        stale (that step's bookkeeping runs once the next plain step is launched): a switch
        it makes applies a step later. A drafter still indexing new prompts decodes plainly
        meanwhile, as does a bucket whose plain step is on the GPU already (its proposals
        would wait for the indexing while the GPU idles: H100, 0.5B, ShareGPT second turns
        at 32, one drafting step of 60-90 ms a run, ~15% of it); the bucket stays in
        drafting mode."""
        adaptive = self.adaptive
        draft = self.drafter is not None and (adaptive is None or adaptive.should_draft(len(reqs)))
        if draft and (plain_step_ahead or (adaptive is not None and not hints(self.drafter).ready_to_draft())):
            return False
        return draft

    def drafts_ahead(self, reqs: list[Req]) -> bool:
        """Whether a drafting step of these requests runs launched ahead (drafting_step.py):
        proposals that read committed tokens only, and greedy requests, with or without a
        grammar, or sampled ones verified on the device: a fused drafter's step's kind
        (FusedSteps.samples_fused), else the sampler's (Sampler.samples_on_device)."""
        if not self.drafter.proposes_ahead:
            return False
        # a grammar's masks apply after the device's unmasked verification (grammar/greedy_paths.py),
        # except in a fused drafter's step, whose next drafts follow the unmasked outcome on the device
        fused = isinstance(self.drafter, FusedSteps)
        if self.sampler.argmax_is_enough(reqs) or (self.sampler.masked_argmax_is_enough(reqs) and not fused):
            return True
        # sampled: in a fused drafter's step, or by the sampler on the device (Sampler.verify_on_device)
        return (fused and self.fused_kind(reqs) is not None) or self.sampler.samples_on_device(reqs)

    def fused_kind(self, reqs: list[Req]) -> str | None:
        """The verification a fused drafter's step launched ahead runs for these requests:
        greedy, a sampled kind its step verifies, or None (the engine's sampler verifies them)."""
        if self.sampler.argmax_is_enough(reqs):
            return "greedy"
        return self.drafter.samples_fused(reqs, self.sampler.sampling_rule)

    def drafts_next(self, reqs: list[Req]) -> bool:
        """Whether the next step of this batch drafts, asked as the step is launched ahead
        (should_draft moves the policy's modes)."""
        return self.adaptive is None or self.adaptive.should_draft(len(reqs))

    def propose(self, reqs: list[Req], limits: list[int] | None = None) -> tuple[TreeProposal, list[int], Shadows | None]:
        """The proposal cut to the policy's choice of size, then to the requests' grammars (their
        forbidden drafts cut, forced ones added: grammar/drafts.py), and its full proposals as the
        policy's shadows (None without a policy), for record_shadows once the step is launched."""
        limits = limits if limits is not None else self.limits(reqs)
        proposal, num_nodes = self.drafter.propose(reqs, limits)
        shadows = None
        if self.adaptive is not None:
            shadows = Shadows([r.rid for r in reqs], proposal, num_nodes, hints(self.drafter).proposal_keys())
            num_nodes = self.adaptive.choose_nodes(shadows.rids, num_nodes, shadows.keys)
            proposal = proposal.cut(num_nodes)
        if any(r.grammar is not None for r in reqs):
            masked = [not self.sampler.masked_argmax_is_enough([r]) for r in reqs]   # sampling: masks every node
            proposal = constrain_proposal(reqs, proposal, limits, masked)
            num_nodes = proposal.num_nodes.tolist()
        return proposal, num_nodes, shadows

    def choose_chained(self, reqs: list[Req], proposal: TreeProposal, num_nodes: list[int],
                       keys: list[int] | None) -> tuple[Shadows | None, int | None]:
        """The policy's choice for a step queued before the step before was read (a fused
        chain's, or one picked from a forecast: its evidence and episode bookkeeping; the step
        verifies its trees whatever the tier, and a choice of plain decoding applies from the
        next step), given the trees the drafter proposed. Returns its shadows and the tier
        chosen (None without a policy)."""
        if self.adaptive is None:
            return None, None
        shadows = Shadows([r.rid for r in reqs], proposal, num_nodes, keys)
        return shadows, self.adaptive.choose(shadows.rids, num_nodes, shadows.keys)

    def record_shadows(self, shadows: Shadows | None) -> None:
        if shadows is not None:
            self.adaptive.record_proposals(shadows.rids, shadows.proposal, shadows.num_nodes, shadows.keys)

    def plain_rows_may_run_ahead(self, batch_size: int) -> bool:
        """Whether the next plain step of `batch_size` requests may be launched before this one's
        tokens are read: not where it would draft. A drafting bucket whose drafter is behind
        with its indexing launches its plain steps ahead too: they would not draft either, and
        each one not launched ahead left the GPU idle while the host worked (H200, 0.5B,
        ShareGPT second turns at 32: the first 20 steps of a run, 1.55-1.77 ms each against
        ~1.2 launched ahead, while 32 new prompts were indexed)."""
        drafter, adaptive = self.drafter, self.adaptive
        if drafter is None:
            return True
        return not ((adaptive is None or adaptive.would_draft(batch_size)) and hints(drafter).ready_to_draft())

    def may_run_dry(self, batch_size: int) -> bool:
        """Whether a batch of this size with nothing to draft may decode on plain steps launched
        ahead (DRY_STRETCH_MAX_BATCH), where larger ones verify roots alone."""
        return batch_size <= DRY_STRETCH_MAX_BATCH

    def runs_dry(self, reqs: list[Req]) -> bool:
        """Whether the drafter, whose proposals are cheap, proposes nothing to verify for any of
        these requests now: the step after this plain one would verify roots alone, a plain step
        that costs a drafting step's unhidden host time (H200, 1.5B, NGRAM at batch 1 on agentic
        tools: 1.8-2.1 ms against 1.2-1.4 launched ahead, ~30 such steps a run), so it is launched
        ahead as a plain step instead. The proposal is not the policy's evidence: it is asked
        again, one token later, by the drafting step that follows a stretch that ends."""
        if not self.drafter.proposes_cheaply or not self.may_run_dry(len(reqs)):
            return False
        self.drafter.flush()   # the tokens the last plain steps committed, indexed first
        _, num_nodes = self.drafter.propose(reqs, self.limits(reqs))
        return max(num_nodes) == 1

    # --- after a step ---
    def admit(self) -> None:
        """New requests decode from the next step: a probe looks at them first."""
        if self.adaptive is not None:
            self.adaptive.admit()

    def record_step(self, batch_size: int, tree_size: int, seconds: float, tokens: int, steady: bool,
                    nodes: int | None = None) -> None:
        """The step's price (adaptive_costs.py); `steady`: it ran as its mode runs its steps.
        Whether its proposals fed the drafter a prompt goes with it (ProposalHints.took_prefill)."""
        self.adaptive.record_step(batch_size, tree_size, seconds, tokens, steady, nodes,
                                  prefill=hints(self.drafter).took_prefill())

    def show_policy(self, reqs: list[Req], committed: list[list[int]]) -> None:
        """A drafting step's committed tokens, shown to the policy before the next step's choice."""
        if self.adaptive is not None:
            self.adaptive.observe_batch([req.rid for req in reqs], committed)

    def observe(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Shows a step's committed tokens to the policy and the drafter, one call each for the
        batch: on every plain step (no shadow walk pending, one token each) calls per request
        and the accept-length stats cost ~41 us at batch 64 on a CPU core, ~35 us batched. A
        finished request's state is gone already. Returns the outputs."""
        if self.drafter is not None:
            reqs, committed = unfinished(outputs)
            if self.adaptive is not None and self.adaptive.walking:   # no rid list on the other steps
                self.adaptive.observe_batch([req.rid for req in reqs], committed)
            self.drafter.observe_batch(reqs, committed)
        return outputs

    def release(self, req: Req) -> None:
        """The request finished or was aborted."""
        if self.drafter is not None:
            self.drafter.release(req)
        if self.adaptive is not None:
            self.adaptive.release(req.rid)

    # --- probes: a plain step's proposals for a few requests, shadows only ---
    def probe_due(self, reqs: list[Req]) -> bool:
        """Whether this plain step probes (adaptive/policy.py: every k-th plain step, k from the
        probes' measured host time; at least every `drafter.probe_every`-th for a model
        drafter, whose proposals cost draft forwards, and at most `drafter.probe_every_at_most`);
        put off while the drafter's background bookkeeping is far behind (the probe would wait for it)."""
        return (self.adaptive is not None and hints(self.drafter).ready_to_probe()
                and self.adaptive.probe_due(len(reqs), self.drafter.probe_every, self.drafter.probe_every_at_most))

    def rare_probe(self, reqs: list[Req], probing: bool) -> bool:
        """Whether this step probed where most plain steps of its bucket do not: then it is
        no plain step as plain mode runs them (where every plain step probes, it is one)."""
        return probing and self.adaptive.probe_every(len(reqs)) > 1

    def put_off_probe(self, reqs: list[Req]) -> None:
        self.adaptive.put_off_probe(len(reqs))

    def probe(self, reqs: list[Req]) -> None:
        """Proposals for a few of the requests, kept as the adaptive policy's shadows only
        (nothing is verified). Its host time is the probe's cost: the proposals include the
        wait for the indexing they need (what the drafter's writer has not finished while
        the GPU computed)."""
        start = time.perf_counter()
        sample = self._probe_sample(reqs)
        if sample:
            proposal, num_nodes = self.drafter.propose_probe(sample, self.limits(sample))
            rids, keys = [r.rid for r in sample], hints(self.drafter).proposal_keys()
            self.adaptive.record_proposals(rids, proposal, num_nodes, keys)
            self.adaptive.probe(len(reqs), rids, num_nodes, keys)
        self.adaptive.record_probe(len(reqs), time.perf_counter() - start)

    def _probe_sample(self, reqs: list[Req]) -> list[Req]:
        """The requests a probe proposes for: a window rotating through the batch, or, where it
        samples part of the batch and the drafter's proposals cost more for some requests, the
        cheapest: a model drafter's proposal first feeds every row the request's draft cache
        lacks, for a new request its whole prompt (H200, 1.5B, EAGLE-3 held plain at 64: one
        probe of 16 requests, ~10 ms, was all the adaptive engine lost to plain on code-types;
        how much of it was that catch-up was not profiled)."""
        window = self.adaptive.probe_requests(len(reqs))   # at most the batch: no request twice
        if len(window) < len(reqs):
            live = [r for r in reqs if not r.finished]
            order = hints(self.drafter).probe_order(live)
            if order is not None:
                return [live[i] for i in order[:len(window)]]
        return [reqs[i % len(reqs)] for i in window if not reqs[i % len(reqs)].finished]
