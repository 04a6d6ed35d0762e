"""The adaptive policy on a batch-1 EAGLE-3 bucket (a fused chain of 3), simulated: no model,
no GPU, step costs of an H200 policy trace (Qwen2.5-Coder-1.5B, the kept head, `scripts/gpu_run.sh
hybrid-rows`, docs/bench/h200_2026-12-02d), drafts whose nodes are each accepted with probability `p` down the chain.

The run is bench.model_drafters' batch-1 cell: one policy warms up on 4 answers of 64 tokens,
then runs the 4 timed answers of 120 tokens, so what the warm-up leaves (prices, evidence,
overshoot records, the probe schedule) decides the timed run's first probes, as it did on the
GPU (code-types: the timed run's first probe expected 1.28x and stayed plain, 1.00x where
drafting every step made 1.53x). The engine's calls come in its order (engine/plain_step.py,
verify_step.py): should_draft; on plain steps probe_due with the drafter's probe_every /
probe_every_at_most, would_draft and the probe after the commit; on drafting steps the full
proposal, then choose; observe and record_step after each step.

Costs (the trace's): a plain step 1.25 ms (the first after a prefill 1.4, not launched ahead);
a chained drafting step 2.2 ms, an episode's first 3.7 (the head's catch-up of the plain
stretch, a makeshift price); a probe 3.3 ms plus 6.5 us per plain step since the head was
last fed. `p` = 0.8 gives ~2.95 tokens a step (code-types, pinned: 2.98), 0.62 ~2.24 (chat).

`--costs sampled`: an H100's sampled step costs (T 0.7, top-p 0.95: a plain step 1.79 ms, a
chained one 2.92), where the same accepts pay less per step.

`python -m lab.policy_sim_b1` prints one JSON line per accept probability: the timed run's
drafting fraction and its time against plain decoding's, means over the seeds, beside
`pinned` (drafting every step, chained: the expected tokens a step at a drafting step's cost).
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.model_drafters.eagle import EagleDrafter
from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
from specserve.verify.tree import TreeProposal

TIERS = [1, 4]              # a fused chain of 3's (AdaptiveDraftLength.for_drafter: plain or the whole chain)
CHAIN_PARENTS = [-1, 0, 1, 2]
WARM_UP, TIMED = (4, 64), (4, 120)   # (answers, tokens each)


@dataclass(frozen=True)
class Costs:
    """Seconds a step of each kind takes (the H200 trace's, greedy, by default)."""
    plain: float = 1.25e-3
    first_plain: float = 1.4e-3      # the first after a prefill, not launched ahead
    draft: float = 2.2e-3            # a chained drafting step
    catch_up: float = 3.7e-3         # an episode's first drafting step
    probe: float = 3.3e-3
    probe_per_held_step: float = 6.5e-6


GREEDY = Costs()
# sampled at T 0.7, top-p 0.95 (H100, the kept head, session 79's trace: docs/bench/h100_2026-12-07e): a plain
# step 1.79 ms, a chained one 2.92; the rest scaled from the greedy ones by the plain steps' ratio
SAMPLED = Costs(plain=1.79e-3, first_plain=1.79e-3 * 1.4 / 1.25, draft=2.92e-3, catch_up=3.7e-3 * 2.92 / 2.2,
                probe=3.3e-3 * 1.79 / 1.25, probe_per_held_step=6.5e-6)
COSTS = {"greedy": GREEDY, "sampled": SAMPLED}


class ChainBucket:
    """One request at a time through one policy; tokens are a function of (answer, position), and a
    proposal's first k drafts are the answer's next tokens, k ~ a chain accepted node by node."""

    def __init__(self, p: float, seed: int, policy: AdaptiveDraftLength, costs: Costs = GREEDY):
        self.p, self.rng, self.policy, self.costs = p, random.Random(seed), policy, costs
        self.answers = 0
        self.held = 0               # plain steps since the head was last fed

    def run(self, answers: int, length: int) -> tuple[int, int, float]:
        """(decode steps, drafting steps, seconds) of `answers` answers of `length` tokens."""
        steps = drafting = 0
        seconds = 0.0
        for _ in range(answers):
            rid, position, first = str(self.answers), 0, True
            self.answers += 1
            self.policy.admit()
            chained = False
            while position < length:
                steps += 1
                if self.policy.should_draft(1):
                    count, cost, tree, steady = self._drafting_step(rid, position, length, chained)
                    chained = tree > 1
                    drafting += tree > 1
                else:
                    count, cost, tree, steady = self._plain_step(rid, position, first)
                    chained = False
                first = False
                position += count
                seconds += cost
                self.policy.observe(rid, [self._token(rid, position - count + i) for i in range(1, count + 1)])
                self.policy.record_step(1, tree, cost, count, steady=steady)
            self.policy.release(rid)
        return steps, drafting, seconds

    def _drafting_step(self, rid: str, position: int, length: int, chained: bool) -> tuple[int, float, int, bool]:
        tree, matched = self._proposal(rid, position)
        self.policy.record_proposals([rid], tree, [len(CHAIN_PARENTS)])
        [nodes] = self.policy.choose_nodes([rid], [len(CHAIN_PARENTS)])
        self.held = 0
        if nodes == 1:
            return 1, self.costs.plain, 1, True
        count = min(matched + 1, nodes, length - position)
        return count, self.costs.draft if chained else self.costs.catch_up, nodes, chained

    def _plain_step(self, rid: str, position: int, first: bool) -> tuple[int, float, int, bool]:
        probing = self.policy.probe_due(1, EagleDrafter.probe_every, EagleDrafter.probe_every_at_most)
        self.policy.would_draft(1)
        if probing:
            tree, _ = self._proposal(rid, position)
            self.policy.record_proposals([rid], tree, [len(CHAIN_PARENTS)])
            self.policy.probe(1, [rid], [len(CHAIN_PARENTS)])
            self.policy.record_probe(1, self.costs.probe + self.costs.probe_per_held_step * self.held)
            self.held = 0
        self.held += 1
        return 1, self.costs.first_plain if first else self.costs.plain, 1, not (probing or first)

    def _proposal(self, rid: str, position: int) -> tuple[TreeProposal, int]:
        matched = 0
        while matched < len(CHAIN_PARENTS) - 1 and self.rng.random() < self.p:
            matched += 1
        ahead = [self._token(rid, position + i) for i in range(1, len(CHAIN_PARENTS))]
        drafts = ahead[:matched] + [token + 1 for token in ahead[matched:]]
        return TreeProposal.from_lists([([0] + drafts, CHAIN_PARENTS)]), matched

    @staticmethod
    def _token(rid: str, position: int) -> int:
        return (int(rid) * 7919 + position * 104729) % 1000 * 2   # even: a missed draft (token + 1) never matches


def timed_cell(p: float, seed: int, costs: Costs = GREEDY) -> tuple[float, float]:
    """(drafting fraction, speed against plain decoding) of the timed run after the warm-up."""
    policy = AdaptiveDraftLength(TIERS, switch_margin=FusedChainDrafter.switch_margin, ragged=False,
                                 leave_margin=FusedChainDrafter.leave_margin)
    bucket = ChainBucket(p, seed, policy, costs)
    bucket.run(*WARM_UP)
    steps, drafting, seconds = bucket.run(*TIMED)
    answers, length = TIMED
    return drafting / steps, answers * length * costs.plain / seconds


def pinned_speed(p: float, costs: Costs = GREEDY) -> float:
    """Drafting every step, chained (the episode's first step aside): expected tokens a step
    (1 + p + p^2 + p^3) at a drafting step's cost, against plain decoding."""
    return sum(p ** k for k in range(len(CHAIN_PARENTS))) * costs.plain / costs.draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--accept", type=float, nargs="+", default=[0.8, 0.62])
    parser.add_argument("--costs", default="greedy", choices=sorted(COSTS),
                        help="step costs: the H200 trace's greedy ones, or an H100's sampled (T 0.7, top-p 0.95)")
    ns = parser.parse_args()
    costs = COSTS[ns.costs]
    for p in ns.accept:
        cells = [timed_cell(p, seed, costs) for seed in range(ns.seeds)]
        print(json.dumps({"p": p, "seeds": ns.seeds, "costs": ns.costs, "pinned": round(pinned_speed(p, costs), 3),
                          "drafting_fraction": round(sum(f for f, _ in cells) / len(cells), 3),
                          "vs_plain": round(sum(v for _, v in cells) / len(cells), 3),
                          "vs_plain_min": round(min(v for _, v in cells), 3)}))


if __name__ == "__main__":
    main()
