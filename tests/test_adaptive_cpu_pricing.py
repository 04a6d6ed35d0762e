"""The adaptive policy of a CPU engine (cost_per_node), where a verify step's cost grows with
its nodes (SmolLM2-135M on a busy 2-core machine, a 16-node step ~4x a plain one): a priced
large tier floors a smaller, unpriced one only in proportion to their draft nodes, so the
small tiers whose drafts pay are tried; and choices or switches rated at a floor price (a
bound, not an expectation) leave no record of overshooting that would raise the switch margin."""
from __future__ import annotations

import pytest

from specserve.speculative.adaptive.costs import StepCosts
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.verify.tree import TreeProposal

TIERS = [1, 2, 4, 8, 16]
PLAIN_S, SIXTEEN_S = 0.050, 0.200
CHAIN = (list(range(20, 36)), [-1] + list(range(15)))   # a 16-node chain: root 20, then 21, 22, ...


def test_a_large_tier_floors_smaller_ones_by_their_nodes():
    costs = StepCosts(TIERS, cost_per_node=True)
    costs.record(1, 1, PLAIN_S)
    costs.record(1, 16, SIXTEEN_S)
    added = SIXTEEN_S - PLAIN_S
    for tier in (2, 4, 8):
        assert costs.price(1, tier) == pytest.approx(PLAIN_S + added * (tier - 1) / 15)
    costs.record(1, 2, 0.100)                            # a smaller priced tier bounds larger ones whole
    assert costs.price(1, 4) == pytest.approx(PLAIN_S + 0.050)
    assert costs.price(1, 8) == pytest.approx(PLAIN_S + added * 7 / 15)   # ... the larger one still by its nodes


def cpu_like_policy() -> AdaptiveDraftLength:
    """Bucket 1 held plain at PLAIN_S a step, tier 16 priced at 4x that, and drafts whose first
    three nodes are accepted: a 4-node cut commits 4 tokens, a 16-node one no more."""
    adaptive = AdaptiveDraftLength(TIERS, ragged=True, cost_per_node=True)
    for _ in range(3):
        adaptive.record_step(1, 16, SIXTEEN_S)
    assert not adaptive.should_draft(1)                  # a new bucket starts plain
    for _ in range(4):
        adaptive.record_step(1, 1, PLAIN_S, tokens=1)
    for _ in range(30):
        adaptive.record_proposals(["old"], TreeProposal.from_lists([CHAIN]), [16])
        adaptive.observe("old", [21, 22, 23, 99])
    return adaptive


def test_a_probe_switches_to_the_small_tier_that_pays():
    adaptive = cpu_like_policy()
    adaptive.record_proposals(["new"], TreeProposal.from_lists([CHAIN]), [16])
    adaptive.probe(1, ["new"], [16])
    assert adaptive.would_draft(1) and adaptive.should_draft(1)
    assert adaptive.choose(["new"], [16]) == 4
    assert adaptive.modes.episode_overshoot == {}


def test_a_choice_rated_at_a_floor_price_leaves_no_overshoot():
    adaptive = cpu_like_policy()
    adaptive.modes.request_switch(1)
    assert adaptive.would_draft(1) and adaptive.should_draft(1)
    assert adaptive.choose(["old"], [16]) == 4           # level 4 unpriced: rated at its floor
    adaptive.record_step(1, 4, 0.080, tokens=1)
    assert 1 not in adaptive.optimism


@pytest.mark.parametrize("expected_gain, verdict", [(None, False), (1.5, True)])
def test_a_losing_episode_that_priced_tiers_is_no_verdict(expected_gain, verdict):
    """An episode a probe started to price tiers (no gain expected) that loses neither doubles
    the bucket's hold nor sets a bypass budget; one that expected a gain and lost does both."""
    from specserve.speculative.adaptive.modes import PLAIN_HOLD, BucketModes
    modes = BucketModes()
    assert not modes.should_draft(1, 0)
    for step in range(4):
        modes.record_outcome(1, tokens=1, seconds=PLAIN_S, steps=step)
    modes.request_switch(1, expected_gain)
    assert modes.would_draft(1, 4) and modes.should_draft(1, 4)
    for step in range(4, 7):
        modes.record_outcome(1, tokens=2, seconds=SIXTEEN_S, steps=step)   # 10 tok/s against plain's 20
    modes.go_plain(1, 7)
    assert (modes.hold[1] == 2 * PLAIN_HOLD) is verdict
    assert (modes.bypass_after.get(1, 0.0) > 0) is verdict
