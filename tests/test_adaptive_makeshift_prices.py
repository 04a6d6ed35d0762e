"""The adaptive policy's drafting prices come from steps run as drafting mode runs them: one
step launched when the scheduler asked for it (an episode's first, which a model drafter's
catch-up makes several steps long) is no price to choose by, nor a floor for other buckets;
a drafter's own switch margin (a fused chain's) lets a probe switch where the default does not."""
from __future__ import annotations

import pytest

from specserve.speculative.adaptive.costs import MIN_SAMPLES, StepCosts
from specserve.speculative.adaptive.policy import SWITCH_MARGIN, AdaptiveDraftLength
from specserve.verify.tree import TreeProposal

CHAIN = ([9, 1, 2, 3], [-1, 0, 1, 2])


def test_one_makeshift_step_leaves_a_drafting_tier_unpriced_until_a_steady_one():
    costs = StepCosts([1, 4])
    costs.record(4, 1, 0.002)                          # plain decoding, steady
    costs.record(4, 4, 0.007, steady=False)            # an episode's first step
    assert costs.unpriced(4, [1, 4]) == [4]
    assert costs.price(4, 4) == pytest.approx(0.002)   # its floor: nothing steady says it adds more
    costs.record(4, 4, 0.003)                          # chained: steady, replaces the makeshift price
    assert costs.unpriced(4, [1, 4]) == [] and costs.seconds[(4, 4)] == pytest.approx(0.003)
    costs.record(4, 4, 0.009, steady=False)            # later makeshift steps only advance the clock
    assert costs.seconds[(4, 4)] == pytest.approx(0.003)


def test_makeshift_steps_price_a_tier_once_there_are_enough_of_them():
    """Where no drafting step runs ahead (a batch turning over every step) a tier is rated by
    the median of MIN_SAMPLES makeshift steps rather than left unpriced for good."""
    costs = StepCosts([1, 4])
    costs.record(4, 1, 0.002)
    for seconds in [0.007, 0.004, 0.005][:MIN_SAMPLES]:
        assert costs.unpriced(4, [4]) == [4]
        costs.record(4, 4, seconds, steady=False)
    assert costs.unpriced(4, [4]) == [] and costs.seconds[(4, 4)] == pytest.approx(0.005)


def test_a_makeshift_price_is_no_floor_for_other_buckets():
    costs = StepCosts([1, 4])
    for bucket, plain in ((4, 0.0017), (8, 0.0018)):
        costs.record(bucket, 1, plain)
    costs.record(4, 4, 0.007, steady=False)
    assert costs.floor(8, 4) == pytest.approx(0.0018)      # not 0.0018 + (0.007 - 0.0017)
    costs.record(4, 4, 0.0030)
    assert costs.floor(8, 4) == pytest.approx(0.0018 + 0.0013)


def test_an_episode_goes_on_past_a_dear_first_step_and_then_chooses_by_the_steady_price():
    """Tier 4 expected to commit 2 tokens against plain's 1 at 2 ms: a first step of 7 ms
    would end the episode at its next choice were it a price; the next step prices it."""
    adaptive = AdaptiveDraftLength([1, 4])
    for _ in range(4):
        adaptive.record_step(4, 1, 0.002, tokens=4)
    for _ in range(30):
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [4])
        adaptive.observe("r", [1, 8])                 # 2 tokens a step
    adaptive.record_step(4, 4, 0.007, tokens=8, steady=False)
    assert adaptive.choose(["r"] * 4, [4] * 4) == 4   # to be priced: the episode goes on
    adaptive.record_step(4, 4, 0.003, tokens=8)       # 2 tokens per 3 ms against 1 per 2 ms
    assert adaptive.choose(["r"] * 4, [4] * 4) == 4
    adaptive.record_step(4, 4, 0.005, tokens=8)
    adaptive.record_step(4, 4, 0.005, tokens=8)       # median 5 ms: 2 per 5 ms loses
    assert adaptive.choose(["r"] * 4, [4] * 4) == 1


@pytest.mark.parametrize("switch_margin, switches", [(None, False), (1.05, True)])
def test_a_drafters_switch_margin_sets_what_a_probe_must_expect(switch_margin, switches):
    """Tier 4 expected at 1.10x plain: below SWITCH_MARGIN, above a fused chain's 1.05."""
    adaptive = AdaptiveDraftLength([1, 4], switch_margin)
    assert not adaptive.should_draft(1)               # a new bucket starts plain
    for _ in range(4):
        adaptive.record_step(1, 1, 0.050, tokens=1)
    adaptive.record_step(1, 4, 0.091)                 # 2 tokens per 91 ms: 1.10x 1 per 50 ms
    for _ in range(30):
        adaptive.record_proposals(["r"], TreeProposal.from_lists([CHAIN]), [4])
        adaptive.observe("r", [1, 8])                 # 2 tokens a step
    rate_4 = adaptive.expected_tokens("r", 4) / 0.091
    assert 1.05 / 0.05 < rate_4 < SWITCH_MARGIN / 0.05
    adaptive.modes.plain_until[1] = 0                 # its first hold passed
    adaptive.probe(1, ["r"], [4])
    assert adaptive.would_draft(1) is switches
