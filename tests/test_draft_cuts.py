"""The adaptive policy over a ragged verify step (speculative/adaptive/draft_cuts.py): a step is priced
at its level (the smallest tier holding its nodes per request), and a choice cuts the drafts
of classes that do not pay for their nodes to their root alone, while a policy that is not
ragged (a fused drafter's) never cuts."""
from __future__ import annotations

import pytest

from specserve.speculative.adaptive.costs import StepCosts, batch_bucket
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.verify.tree import TreeProposal

CHAIN = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
# a verify step at 8 requests: plain 10 ms, then compute-bound, ~1.5 ms per node a request
COSTS = {1: 0.010, 2: 0.0115, 4: 0.016, 8: 0.022}


def learned(ragged: bool) -> AdaptiveDraftLength:
    """A policy whose class 5 accepts whole chains and class 1 nothing, at 8 requests."""
    adaptive = AdaptiveDraftLength([1, 2, 4, 8], ragged=ragged)
    for tier, seconds in COSTS.items():
        for _ in range(3):
            adaptive.record_step(8, tier, seconds)
    for _ in range(10):
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [8], keys=[1])
        adaptive.observe("r", [99])
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [8], keys=[5])
        adaptive.observe("r", [1, 2, 3, 4, 5, 6, 7, 98])
    return adaptive


def test_weak_classes_verify_their_root_alone_where_strong_ones_draft():
    adaptive = learned(ragged=True)
    rids = [f"r{i}" for i in range(8)]
    keys = [5, 1, 1, 1, 1, 1, 1, 5]
    nodes = adaptive.choose_nodes(rids, [8] * 8, keys)
    assert nodes == [8, 1, 1, 1, 1, 1, 1, 8]
    # 8 + 8 + 6 nodes over 8 requests: under 4 a request, priced at level 4, not 8
    cut = adaptive.choose_cut(rids, [8] * 8, keys)
    assert (cut.tier, cut.level) == (8, 4)


def test_a_policy_that_is_not_ragged_never_cuts():
    adaptive = learned(ragged=False)
    rids = [f"r{i}" for i in range(8)]
    nodes = adaptive.choose_nodes(rids, [8] * 8, [5, 1, 1, 1, 1, 1, 1, 5])
    # every draft verified whole at one tier: 2 strong chains do not pay for 6 weak ones at 8
    assert len(set(nodes)) == 1


def test_without_classes_each_request_is_its_own():
    adaptive = AdaptiveDraftLength([1, 2, 4, 8], ragged=True)
    for tier, seconds in COSTS.items():
        for _ in range(3):
            adaptive.record_step(8, tier, seconds)
    rids = [f"r{i}" for i in range(8)]
    for _ in range(10):
        for i, rid in enumerate(rids):
            adaptive.record_proposals([rid], TreeProposal.from_lists([CHAIN]), [8])
            adaptive.observe(rid, [1, 2, 3, 4, 5, 6, 7, 98] if i == 3 else [99])
    assert adaptive.choose_nodes(rids, [8] * 8) == [1, 1, 1, 8, 1, 1, 1, 1]


def test_a_ragged_step_is_priced_at_the_level_of_its_nodes():
    adaptive = AdaptiveDraftLength([1, 2, 4, 8], ragged=True)
    adaptive.record_step(8, 8, 0.0155, nodes=8 + 2 * 7)     # 22 nodes: 2.75 a request -> level 4
    assert adaptive.costs.seconds == {(batch_bucket(8), 4): 0.0155}
    fixed = AdaptiveDraftLength([1, 2, 4, 8])
    fixed.record_step(8, 8, 0.0155, nodes=8 + 2 * 7)        # not ragged: the largest tree's tier
    assert fixed.costs.seconds == {(batch_bucket(8), 8): 0.0155}


def test_an_unpriced_level_costs_at_least_the_fixed_part_of_a_drafting_step():
    """StepCosts.floor: a level no bucket priced (level 2 here) is floored at plain's price
    plus the least any drafting step adds at a bucket no larger, not at plain's price alone
    (each bucket a chat batch passed through then priced it by steps that lost)."""
    costs = StepCosts([1, 2, 4, 8])
    for _ in range(3):
        costs.record(8, 1, 0.010)
        costs.record(8, 4, 0.016)
        costs.record(32, 1, 0.012)
        costs.record(4, 1, 0.009)
    assert costs.floor(32, 2) == pytest.approx(0.012 + 0.006)
    # no drafting step priced at a bucket <= 4: bucket 8's tier 4 bounds it only by the draft rows,
    # 2 of them (4 / 2 requests, one draft node each) against 8 x 3
    assert costs.floor(4, 2) == pytest.approx(0.009 + 0.006 * 2 / 24)


def test_on_a_cpu_an_unpriced_level_is_floored_in_proportion_to_its_draft_nodes():
    """cost_per_node (a CPU engine): level 2 (one draft node) is floored at a third of what
    level 4 (three draft nodes) adds, not at all of it, so smaller levels still get tried."""
    costs = StepCosts([1, 2, 4, 8], cost_per_node=True)
    for _ in range(3):
        costs.record(8, 1, 0.010)
        costs.record(8, 4, 0.016)
        costs.record(32, 1, 0.012)
    assert costs.floor(32, 2) == pytest.approx(0.012 + 0.006 / 3)
    assert costs.floor(32, 4) == pytest.approx(0.012 + 0.006)


def test_a_ragged_policy_drafts_at_an_unpriced_level_only_where_it_may_win():
    """No level is priced at bucket 32; a drafting step adds 10 ms at bucket 4: weak drafts
    alone stay plain (no step is spent pricing a level that cannot win). Once levels 4 and
    8 are priced there, beside strong drafts only the strong ones draft, at level 4."""
    adaptive = AdaptiveDraftLength([1, 2, 4, 8], ragged=True)
    for _ in range(3):
        adaptive.record_step(4, 1, 0.010)
        adaptive.record_step(4, 8, 0.020, nodes=32)
        adaptive.record_step(32, 1, 0.012)
    for _ in range(10):
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [8], keys=[1])
        adaptive.observe("r", [99])
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [8], keys=[5])
        adaptive.observe("r", [1, 2, 3, 4, 5, 6, 7, 98])
    rids = [f"r{i}" for i in range(32)]
    assert adaptive.choose_nodes(rids, [8] * 32, [1] * 32) == [1] * 32
    for _ in range(3):
        adaptive.record_step(32, 8, 0.030, nodes=32 * 8)
        adaptive.record_step(32, 8, 0.016, nodes=100)       # level 4
    keys = [5] * 8 + [1] * 24
    cut = adaptive.choose_cut(rids, [8] * 32, keys)
    assert cut.drafted == frozenset({5}) and cut.level < 8
