"""Adaptive draft length: each step verifies the draft size (a "tier", 1 = plain decoding)
that maximises expected committed tokens per second of step time, at every batch size.

    tier* = argmax_t  sum_i E[tokens_i | t]  /  cost(batch bucket, t)

Both factors are measured, not assumed:

- cost(bucket, t): the wall time of whole steps, per batch-size bucket and tier, with
  contenders re-measured now and then (costs.py).
- E[tokens_i | t]: a moving average over past proposals of how many tokens a proposal, cut
  to its first t nodes, would have committed: per evidence class when the drafter gives one
  (NGRAM: the length of the matched suffix, so that one-token matches, which rarely pay,
  are told apart from long ones), else per request; learned from "shadow" walks of the
  full proposals (acceptance.py).

A bucket whose best tier is 1 decodes plainly, on the overlapped plain path, until a probe
(proposals made on some plain steps, shadows only: probes.py) says drafting is
expected to win by SWITCH_MARGIN; realized rates guard against the model being wrong
(modes.py). A drafting episode that realized SWITCH_MARGIN over plain leaves its
bucket open, and a small batch probes the plain steps right after it. A probe of new
requests may switch a bucket held plain after a losing episode, but only once that
episode's loss is BYPASS_BUDGET of the bucket's time since (ShareGPT first turns at 64 on
an H100: each completed prefill started another losing episode, 144 drafting steps at
accept 1.6, 0.65x). This file makes the choice and wires the parts together.

Cutting a tree to its first t nodes keeps a valid tree (parents come before children),
and the tiers are sizes the CUDA graphs were captured for, so replay stays valid.

Ragged (drafters whose steps verify through the runner's ragged step: its cost follows the
nodes verified, not the largest tree): a step is priced at its level, the smallest tier
that holds its nodes per request, and a choice at tier t may cut the classes whose drafts
do not pay for their nodes to their root alone (draft_cuts.py: TierCuts rates the cuts); a
level not priced at the bucket yet is rated at its floor and priced by the steps that choose it.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from specserve.speculative.adaptive.acceptance import AcceptanceEvidence
from specserve.speculative.adaptive.costs import COST_WINDOW, REFRESH_EVERY, StepCosts, batch_bucket
from specserve.speculative.adaptive.draft_cuts import (PLAIN, REFRESH_MARGIN, DraftClasses, DraftCut, TierCuts,
                                                     draft_classes)
from specserve.speculative.adaptive.modes import (
    BYPASS_BUDGET, GUARD_RATIO, GUARD_STEPS, MAX_PLAIN_HOLD, PLAIN_HOLD, REALIZED_WINDOW, BucketModes)
from specserve.speculative.adaptive.overshoot import ChoiceOvershoot
from specserve.speculative.adaptive.probes import (
    MAX_PROBE_EVERY, PROBE_BUDGET, PROBE_COST_EMA, PROBE_REQUESTS, ProbeSchedule)

if TYPE_CHECKING:
    from specserve.speculative.adaptive.listener import PolicyListener
    from specserve.speculative.drafter import Drafter
    from specserve.verify.tree import TreeProposal

__all__ = [
    "AdaptiveDraftLength", "tiers_for", "COST_WINDOW", "REFRESH_EVERY", "REFRESH_MARGIN", "SWITCH_MARGIN", "EXPLORE_RATIO",
    "BYPASS_BUDGET", "GUARD_RATIO", "GUARD_STEPS", "MAX_PLAIN_HOLD", "PLAIN_HOLD", "REALIZED_WINDOW",
    "MAX_PROBE_EVERY", "PROBE_BUDGET", "PROBE_COST_EMA", "PROBE_REQUESTS", "OPTIMISM_WINDOW", "MAX_OPTIMISM",
    "LEAVE_MARGIN_BATCH"]

# a plain bucket drafts again only when drafting is expected to beat plain by this much:
# a switch costs a step that is not launched ahead, and a probe sees only a sample, so
# without a margin the two modes can alternate step by step
SWITCH_MARGIN = 1.15
# ... or when a drafting tier's price is stale (costs.py) and, at that price, drafting
# is expected to reach this fraction of plain's rate: the episode re-prices it. Without it a
# bucket held plain kept prices a few drafting steps took long before (H100, 0.5B, code-rename
# at 64: tier 8 priced at ~18k tok/s against plain's 50.6k, held plain, 0.92x where it had
# drafted at 1.24x); the guard stops an episode that loses after GUARD_STEPS steps.
EXPLORE_RATIO = 0.6
# A probe's switch is judged with the bucket's record: over its last OPTIMISM_WINDOW drafting
# steps, the rate the choices expected over the rate the steps realized (overshoot.py;
# at least 1, at most MAX_OPTIMISM) multiplies SWITCH_MARGIN. Where the model overshoots, each switch is a
# drafting step that loses and two steps not launched ahead (H100, 1.5B, a 16-node chain,
# ShareGPT at 64: 5-9 switches a run, expected/realized 1.12-1.35, ~15 ms lost each; at batch 1
# 2-3x); where it does not (code edits: 0.84-1.1) nothing changes. A stale tier's re-pricing
# (EXPLORE_RATIO) is not held back, so a bucket's record is renewed now and then. At most 1.5:
# on a busy CPU, load that moves between the steps that priced a tier and the steps that ran it
# reads as ~2x overshoot, and a margin of 2.3x is more than drafting gains at batch 1 there
# (SmolLM2-135M, a JSON edit on 2 shared cores: probes expecting 1.6-2.1x kept it plain).
OPTIMISM_WINDOW = 8
MAX_OPTIMISM = 1.5
# A drafter's leave margin (Drafter.leave_margin) holds for steps of this many requests or more;
# a smaller step's expected rate averages fewer requests' noisy evidence, so its episode ends
# further below plain's: 1 - (1 - margin) * sqrt(LEAVE_MARGIN_BATCH / batch) (a fused chain's
# 0.85: 0.70 at batch 1, 0.79 at 2). At batch 1 a request's expected tokens swing with each
# step's accepts: an H100 trace (1.5B, the kept head, chat sampled at T 0.7) ended a warm-up
# episode that realized ~1.0x on one step expected at 0.81x plain, and the bucket stayed plain
# where pinned drafting made 1.43x. lab/policy_sim_b1 (32 seeds, chains of 3, nodes accepted
# with probability p; sampled: H100 sampled step costs), 0.85 -> 0.70 at batch 1: greedy p 0.62
# 1.03 -> 1.07x plain (pinned 1.27x), sampled p 0.62 1.10 -> 1.19x (pinned 1.38x), p 0.8
# 1.59 -> 1.60x / 1.72 -> 1.73x; p 0.2-0.5 (drafting loses) 0.995-1.00x either way.
LEAVE_MARGIN_BATCH = 4
# A probe's verdict goes to the debug log at most this often per bucket: why a speculative
# server keeps a batch size plain (or drafts) is otherwise invisible from outside
DECISION_LOG_INTERVAL_S = 5.0

logger = logging.getLogger("specserve")


class AdaptiveDraftLength:
    def __init__(self, tiers: list[int], switch_margin: float | None = None, ragged: bool = False,
                 cost_per_node: bool = False, leave_margin: float = 1.0):
        """switch_margin: SWITCH_MARGIN where None (a drafter's own: Drafter.switch_margin);
        leave_margin: a drafting episode goes on while its best tier is expected to reach this
        fraction of plain decoding's rate (1.0: until plain is expected to win; a drafter's own:
        Drafter.leave_margin).
        ragged: a step's cost follows the nodes it verifies (Drafter.ragged_verify): a step is
        priced at its level (nodes per request, see record_step) and a choice may cut some
        requests' drafts to their root (DraftCut). cost_per_node: the engine runs on a CPU,
        where a step's cost grows with its draft nodes (StepCosts.floor)."""
        self.tiers = sorted(set(tiers) | {1})
        self.ragged = ragged
        self.cost_per_node = cost_per_node
        self.switch_margin = SWITCH_MARGIN if switch_margin is None else switch_margin
        self.leave_margin = leave_margin
        self.costs = StepCosts(self.tiers, cost_per_node)
        self.modes = BucketModes()
        # read from this module when the policy is built, so that tests which patch
        # specserve.speculative.adaptive.policy.PROBE_BUDGET / MAX_PROBE_EVERY set the schedule
        self.probes = ProbeSchedule(PROBE_BUDGET, MAX_PROBE_EVERY)
        self.evidence = AcceptanceEvidence(self.tiers)
        self.cuts = TierCuts(self.tiers, ragged, self.costs, self.evidence)
        self.listener: PolicyListener | None = None   # see listen
        self.steps_per_tier = {t: 0 for t in self.tiers}
        # bucket -> a stale tier its next drafting step re-prices, and whether that is a second try
        self._explore: dict[int, tuple[int, bool]] = {}
        self._exploring: dict[int, tuple[int, int, bool]] = {}   # bucket -> (tier, level, second try) being re-priced
        self._expected: dict[int, tuple[float, float]] = {}   # bucket -> (tokens, seconds) its choice expected
        self._overshoots = ChoiceOvershoot(OPTIMISM_WINDOW)
        self.optimism: dict[int, float] = {}   # bucket -> expected / realized rate of its drafting steps
        self._decision_logged_at: dict[int, float] = {}   # bucket -> when a probe's verdict was last logged
        self._asked: tuple[int, bool] | None = None   # the last should_draft's bucket and answer

    @classmethod
    def for_drafter(cls, drafter: Drafter, num_draft_tokens: int, graph_sizes: list[int] | None,
                    on_cpu: bool = False) -> AdaptiveDraftLength:
        """The policy of a drafter's engine: tiers up to num_draft_tokens (tiers_for), the
        drafter's switch margin, ragged where its steps verify through the ragged step, and
        step costs that grow with the draft nodes on a CPU. A drafter whose step runs every
        chain whatever the cut (a fused chain's) chooses between plain decoding and its whole
        chain: a cut costs the chain's step for fewer tokens, and its chained steps never
        priced a cut tier, which left the bucket unrated (no rates while a tier is unpriced:
        TierCuts.best) and its episodes ended where plain decoding was merely expected to
        tie, not at leave_margin (H100, EAGLE-3 at 64: a warm-up's episode at 1.22x plain
        ended so, and the timed run decoded all its 123 steps plainly)."""
        tiers = tiers_for(num_draft_tokens, graph_sizes)
        if not drafter.ragged_verify:
            tiers = [1, tiers[-1]]
        return cls(tiers, drafter.switch_margin, drafter.ragged_verify, cost_per_node=on_cpu,
                   leave_margin=drafter.leave_margin)

    def listen(self, listener: PolicyListener | None) -> None:
        """Sends the policy's decisions and their steps to `listener` (None: to nobody)."""
        self.listener = self.modes.listener = listener

    # --- the mode of a step ---
    def should_draft(self, batch_size: int) -> bool:
        """Whether this step drafts: False while its bucket is in plain mode. A switch a
        probe asked for takes effect the step after next (see would_draft). A batch that
        shrinks out of a drafting bucket into a plain one has that bucket probe at once
        (ProbeSchedule.left_drafting)."""
        bucket = batch_bucket(batch_size)
        drafts = self.modes.should_draft(bucket, self.costs.steps(bucket))
        last = self._asked
        if not drafts and last is not None and last[1] and bucket < last[0]:
            self.probes.left_drafting(bucket)
        self._asked = (bucket, drafts)
        return drafts

    def would_draft(self, batch_size: int) -> bool:
        """Whether the step after this one may draft (no plain step is launched ahead then)."""
        bucket = batch_bucket(batch_size)
        return self.modes.would_draft(bucket, self.costs.steps(bucket))

    # --- probes on plain steps ---
    def probe_requests(self, batch_size: int) -> range:
        """Which requests of a plain step to propose for, as shadows (a rotating window)."""
        return self.probes.requests(batch_size)

    def probe_due(self, batch_size: int, every_at_least: int = 1, every_at_most: int | None = None) -> bool:
        """Whether this plain step probes: every k-th plain step of its bucket, k the
        smallest that keeps the probes' host time within PROBE_BUDGET of the plain step's
        cost, never below `every_at_least` (a drafter whose proposals cost forwards) and
        at most `every_at_most` (None: MAX_PROBE_EVERY)."""
        return self.probes.due(batch_bucket(batch_size), every_at_least, every_at_most)

    def put_off_probe(self, batch_size: int) -> None:
        """The probe due at this plain step did not run (no step was in flight to hide it
        behind): the bucket's next plain step probes instead."""
        self.probes.put_off(batch_bucket(batch_size))

    def probe_every(self, batch_size: int) -> int:
        """k for the bucket: 1 until a probe and a plain step have been timed."""
        return self.probes.every(batch_bucket(batch_size))

    def record_probe(self, batch_size: int, seconds: float) -> None:
        """The host time of a probe (its proposals, shadows and the indexing they needed);
        sets the bucket's k against its plain step's current cost."""
        bucket = batch_bucket(batch_size)
        if self.listener is not None:
            self.listener.probe_recorded(bucket, batch_size, seconds)
        self.probes.record(bucket, seconds, self.costs.seconds.get((bucket, 1)))

    def probe(self, batch_size: int, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> None:
        """After a plain step: the sampled requests' proposals (recorded as shadows) say
        whether drafting is expected to win now; if so the bucket drafts again."""
        bucket = batch_bucket(batch_size)
        switched, expected_gain = self._probe_verdict(bucket, batch_size, rids, num_nodes, keys)
        if switched:
            if self.listener is not None:
                self.listener.switch_requested(bucket, expected_gain)
            self.modes.request_switch(bucket, expected_gain)
        self.probes.verdict(bucket, switched)

    def _probe_verdict(self, bucket: int, batch_size: int, rids: list[str], num_nodes: list[int],
                       keys: list[int] | None) -> tuple[bool, float | None]:
        """Whether the bucket should draft again, from a probe's proposals, and the gain over
        plain decoding that drafting is expected to make (None where it drafts to price a tier)."""
        if max(num_nodes) == 1 or not self.modes.may_switch(bucket, self.costs.steps(bucket), rids):
            return False, None
        if not self.costs.steadily_priced(bucket, 1):
            return False, None   # what drafting must beat is not known yet (modes.py: plain_trial)
        _, best, rates, cuts = self._rate(bucket, batch_size, rids, num_nodes, keys)
        if not rates:   # a level is not priced at this bucket yet: drafting prices it, if it may win
            return self.cuts.may_pay(bucket, rids, num_nodes, keys, self.switch_margin_at(bucket)), None
        prices = {t: self.costs.price(bucket, cut.level) for t, cut in cuts.items()}
        if best.tier > 1 and rates[best.tier] >= self.switch_margin_at(bucket) * rates[1]:
            self._log_decision(bucket, batch_size, rates, prices, "drafts")
            # a gain rated at a floor price (best's level not priced yet) is a bound, not an
            # expectation: its episode prices the level and is no record of overshooting
            return True, rates[best.tier] / rates[1] if self.costs.rateable(bucket, best.level) else None
        stale = [t for t, rate in rates.items() if t > 1 and rate >= EXPLORE_RATIO * rates[1]
                 and self.costs.stale(bucket, cuts[t].level)]
        if stale:   # the episode's first step runs the stale tier, whatever its old price says
            self._explore[bucket] = (max(stale, key=rates.get), False)
        self._log_decision(bucket, batch_size, rates, prices,
                           f"drafts to re-price tier {self._explore[bucket][0]}" if stale else "stays plain")
        return bool(stale), None

    def repricing(self, bucket: int) -> int | None:
        """The stale tier the bucket's next drafting step re-prices, if a probe switched it for that."""
        explore = self._explore.get(bucket)
        return None if explore is None else explore[0]

    def _log_decision(self, bucket: int, batch_size: int, rates: dict[int, float], prices: dict[int, float],
                      verdict: str) -> None:
        """A probe's verdict with what it rests on, per tier: the expected rate, the step's
        price (its level's) and the tokens a request is expected to commit (debug log, rate-limited)."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        now = time.monotonic()
        if now - self._decision_logged_at.get(bucket, -DECISION_LOG_INTERVAL_S) < DECISION_LOG_INTERVAL_S:
            return
        self._decision_logged_at[bucket] = now
        tiers = ", ".join(f"{t}: {rate:.0f} tok/s ({1e3 * prices[t]:.2f} ms a step, "
                          f"{rate * prices[t] / batch_size:.2f} tokens a request)"
                          for t, rate in sorted(rates.items()))
        logger.debug("speculative policy, batch %d (bucket %d): %s; switch margin %.2f: %s",
                     batch_size, bucket, tiers, self.switch_margin_at(bucket), verdict)

    def switch_margin_at(self, bucket: int) -> float:
        """The switch margin, times how much the bucket's drafting choices, or the probes that
        started its episodes (modes.py: episode_overshoot), overshot of late."""
        overshoot = max(self.optimism.get(bucket, 1.0), self.modes.episode_overshoot.get(bucket, 1.0), 1.0)
        return self.switch_margin * min(overshoot, MAX_OPTIMISM)

    # --- the choice ---
    def choose(self, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> int:
        """The tier to verify this drafting step (the most nodes a request's draft keeps),
        given each request's proposal size (and class); choosing 1 puts the bucket in plain
        mode. choose_nodes says which requests draft."""
        return self.choose_cut(rids, num_nodes, keys).tier

    def choose_nodes(self, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> list[int]:
        """choose, as the nodes each request's proposal is cut to (1: its root alone)."""
        cut = self.choose_cut(rids, num_nodes, keys)
        tier, drafted = cut.tier, cut.drafted
        if drafted is None:
            return [min(n, tier) for n in num_nodes]
        return [min(n, tier) if c in drafted else 1 for n, c in zip(num_nodes, draft_classes(rids, keys))]

    def choose_cut(self, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> DraftCut:
        """The cut of this drafting step's proposals (see choose)."""
        bucket = batch_bucket(len(rids))
        self.modes.drafted[bucket] = rids   # who a hold that this episode ends with is about
        if max(num_nodes) == 1:
            return PLAIN  # nothing to verify: says nothing about whether drafting pays
        explore = self._explore.pop(bucket, None)
        if explore is not None and explore[0] in self.cuts.useful(max(num_nodes)):
            tier, second_try = explore
            cut = self.cuts.at_tiers(bucket, DraftClasses(rids, num_nodes, keys), len(rids), [tier])[tier]
            self._exploring[bucket] = (tier, cut.level, second_try)   # (record_step: did it price the level?)
            return cut
        choice, best, rates, cuts = self._rate(bucket, len(rids), rids, num_nodes, keys, choosing=True)
        if best.tier == 1 and rates and self.leave_margin < 1.0:
            choice, best = self._staying(choice, best, rates, cuts, self.leave_margin_at(len(rids)))
        if not rates and choice.tier > 1 and not self.cuts.may_pay(bucket, rids, num_nodes, keys, 1.0):
            best = choice = PLAIN   # what is left to price cannot win: the episode ends
        if choice.tier > 1 and rates and self.costs.rateable(bucket, choice.level):
            # a choice rated at a floor price (a level not priced yet) expected a lower bound on
            # its cost: its step prices the level, and says nothing about the model's optimism
            self._expected[bucket] = (choice.tokens, self.costs.price(bucket, choice.level))
        if best.tier == 1:  # not a re-measurement of tier 1: plain decoding is expected to win
            if self.modes.go_plain(bucket, self.costs.steps(bucket), reopen_margin=self.switch_margin):
                self._episode_won(bucket)
        elif not self.costs.steadily_priced(bucket, 1) and self.modes.episode_steps(bucket) >= GUARD_STEPS:
            # plain decoding was priced only by steps plain mode does not run (modes.py)
            self.modes.plain_trial(bucket, self.costs.steps(bucket))
            return PLAIN
        return choice

    def leave_margin_at(self, batch_size: int) -> float:
        """The leave margin for a step of this many requests: the drafter's from
        LEAVE_MARGIN_BATCH requests up; below, as far under 1 again as one step's expected
        rate is noisier (its requests' evidence averaged, the noise falling with the square
        root of their number): a fused chain's 0.85 is 0.70 at batch 1 (module docstring)."""
        if self.leave_margin >= 1.0 or batch_size >= LEAVE_MARGIN_BATCH:
            return self.leave_margin
        return 1.0 - (1.0 - self.leave_margin) * math.sqrt(LEAVE_MARGIN_BATCH / batch_size)

    def _staying(self, choice: DraftCut, best: DraftCut, rates: dict[int, float],
                 cuts: dict[int, DraftCut], leave_margin: float) -> tuple[DraftCut, DraftCut]:
        """Where plain decoding is expected to win (best is tier 1), the episode goes on at the
        best drafting tier still expected to reach leave_margin of plain's rate; a choice that
        re-prices another tier stands."""
        drafting = [t for t in rates if t > 1]
        stay = max(drafting, key=rates.get) if drafting else None
        if stay is None or rates[stay] < leave_margin * rates[1]:
            return choice, best
        return (cuts[stay] if choice.tier == 1 else choice), cuts[stay]

    def _rate(self, bucket: int, batch_size: int, rids: list[str], num_nodes: list[int], keys: list[int] | None,
              choosing: bool = False) -> tuple[DraftCut, DraftCut, dict[int, float], dict[int, DraftCut]]:
        """A decision's cuts and rates (TierCuts.best), heard by the listener."""
        rated = self.cuts.best(bucket, batch_size, rids, num_nodes, keys, measure=choosing)
        if self.listener is not None:
            self.listener.rated(bucket, batch_size, rids, num_nodes, keys, choosing, rated[0], rated[2])
        return rated

    def expected_tokens(self, rid: str, tier: int, key: int | None = None) -> float:
        """Tokens a step at this tier is expected to commit for the request (given a draft
        of evidence class `key`, when the drafter gives classes)."""
        return self.evidence.expected_tokens(rid, tier, key)

    # --- evidence ---
    def record_step(self, batch_size: int, tree_size: int, seconds: float, tokens: int | None = None,
                    steady: bool = True, nodes: int | None = None, prefill: bool = False) -> None:
        """A step whose largest tree had tree_size nodes, priced as the smallest tier that
        holds it, or for a ragged policy given its `nodes` (verified in all) at its level,
        the smallest tier holding its nodes per request. `tokens`: what it committed, for
        the realized rates of the bucket's modes. `steady`: False for a plain step that
        plain mode would not have run so (not launched ahead, or probing): it counts, but
        does not price plain decoding (costs.py). `prefill`: its proposals fed the drafter a
        prompt (ProposalHints.took_prefill): it is not steady, its choice's expectation is no
        record of overshooting, and a drafting episode is not judged by it (modes.py)."""
        steady = steady and not prefill
        bucket = batch_bucket(batch_size)
        expected = self._expected.pop(bucket, None)   # what this step's choice expected, if it drafted
        if self.listener is not None:
            self.listener.step_recorded(bucket, batch_size, tree_size, seconds, tokens, steady, nodes, expected,
                                        prefill)
        if nodes is not None and tree_size > 1:
            tree_size = self.cuts.level(tree_size, batch_size, nodes)
        self.probes.note_step(bucket)
        if expected is not None and tree_size > 1 and tokens is not None and seconds > 0 and not prefill:
            self.optimism[bucket] = self._overshoots.add(bucket, *expected, tokens=tokens, seconds=seconds)
        tier = self.costs.record(bucket, tree_size, seconds, steady)
        self.steps_per_tier[tier] += 1
        self._explored(bucket, tier, steady)
        if tokens is not None and seconds > 0 and self.modes.record_outcome(
                bucket, tokens, seconds, self.costs.steps(bucket), batch_size, prefill, self.switch_margin):
            self._episode_won(bucket)   # stopped by its recent steps, it had won all the same

    def _episode_won(self, bucket: int) -> None:
        """An episode that ended having beaten plain decoding by the switch margin: its drafts
        may be back in a few tokens, and it ended on the steps that disappointed its choices, so
        they leave no record of overshoot (kept, a won episode's early over-promise raises the
        switch margin against the drafts that won it)."""
        self.probes.reopen(bucket)
        self._overshoots.clear(bucket)
        self.optimism.pop(bucket, None)

    def _explored(self, bucket: int, level: int, steady: bool) -> None:
        """After a step that re-priced a stale tier: where it was makeshift (an episode's first
        step, launched when the scheduler asked for it) and the level's price was steady, it
        priced nothing (costs.py), and the level stays stale; the next step, launched ahead,
        tries once more. Without it the same stale level was re-priced by a whole episode every
        14-65 steps, 3-4 times a run (H100, 1.5B, ShareGPT at 32/64: 18 of 37 chat episodes
        were re-pricing ones), each a drafting step at 0.6-1.1 of plain's expected rate."""
        exploring = self._exploring.pop(bucket, None)
        if exploring is None:
            return
        tier, explored_level, second_try = exploring
        if level == explored_level and not steady and not second_try and self.costs.stale(bucket, level):
            self._explore[bucket] = (tier, True)

    def record_proposals(self, rids: list[str], trees: TreeProposal, num_nodes: list[int],
                         keys: list[int] | None = None) -> None:
        """Full proposals (before any cut, verified or probes), one shadow per real draft."""
        self.evidence.record(rids, trees, num_nodes, keys)

    @property
    def walking(self) -> bool:
        """Whether a proposal waits for the tokens a step commits (observe_batch has work)."""
        return self.evidence.walking

    def observe_batch(self, rids: list[str], committed: list[list[int]]) -> None:
        """Walks the pending proposals of a step's requests down the tokens each just
        committed (committed[i]: rids[i]'s): the engine calls it once per step."""
        self.evidence.observe_batch(rids, committed)

    def observe(self, rid: str, committed: list[int]) -> None:
        """One request's committed tokens: a batch of one."""
        self.observe_batch([rid], [committed])

    def admit(self) -> None:
        """Requests finished their prefill: the next plain step probes them (their drafts
        may match from the first token whatever the batch's history says)."""
        self.probes.admit()

    def release(self, rid: str) -> None:
        self.evidence.release(rid)


def tiers_for(num_draft_tokens: int, graph_sizes: list[int] | None) -> list[int]:
    """The draft sizes worth choosing between: the captured graph sizes on a GPU (a cut to
    another size would pad to the next graph anyway), else 1, 2, 4, ... up to the maximum."""
    if graph_sizes:
        return sorted(s for s in graph_sizes if s <= num_draft_tokens)
    sizes, size = {num_draft_tokens}, 1
    while size < num_draft_tokens:
        sizes.add(size)
        size *= 2
    return sorted(sizes)
