"""Adaptive draft length: the shadow walk counts exactly what a cut proposal would have
committed, the choice follows measured cost and acceptance (plain decoding included), and
an adaptive engine's greedy output equals plain decoding while it switches draft sizes."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from lab.policy_sim import SCENARIOS, simulate
from specserve.engine.draft_planner import DraftPlanner
from specserve.speculative.drafter import ProposalHints
from specserve.speculative.adaptive.costs import RECHECK_GAP, STALE_AFTER, StepCosts
from specserve.speculative.adaptive.modes import GUARD_WINDOW
from specserve.speculative.adaptive.policy import (
    BYPASS_BUDGET, GUARD_STEPS, MAX_PLAIN_HOLD, MAX_PROBE_EVERY, OPTIMISM_WINDOW, PLAIN_HOLD, PROBE_BUDGET, REFRESH_EVERY,
    SWITCH_MARGIN, AdaptiveDraftLength, tiers_for)
from specserve.speculative.adaptive.probes import ADMIT_GAP, ProbeSchedule
from specserve.verify.tree import DraftTrees, TreeProposal

from tests.spec_fixtures import CODE_PROMPT, SmolEngines, ngram_args, wait_until_all_kv_is_free

# root r; 1:a <- 0, 2:b <- 1, 3:x <- 0, 4:c <- 2, 5:d <- 4   (token ids: r=9, a=1, b=2, x=3, c=4, d=5)
TREE = ([9, 1, 2, 3, 4, 5], [-1, 0, 1, 0, 2, 4])


def propose(adaptive: AdaptiveDraftLength, rid: str, tree=TREE) -> None:
    adaptive.record_proposals([rid], TreeProposal.from_lists([tree]), [len(tree[0])])


def random_tree(rng: random.Random, size: int) -> tuple[list[int], list[int]]:
    return [rng.randrange(50) for _ in range(size)], [-1] + [rng.randrange(i) for i in range(1, size)]


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8])
def test_a_cut_equals_trees_built_from_the_cut_lists(cut):
    rng = random.Random(cut)
    rows = [random_tree(rng, size) for size in (1, 3, 8, 6, 8)]
    proposal = TreeProposal.from_lists(rows, n=8)
    expected = DraftTrees.from_lists([(tokens[:cut], parents[:cut]) for tokens, parents in rows], n=min(cut, 8))
    got = proposal.cut([cut] * len(rows)).trees()
    for name in ("tokens", "parents", "num_nodes", "depth", "ancestor_mask", "first_child", "next_sibling"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_shadow_walk_counts_what_each_cut_would_commit():
    adaptive = AdaptiveDraftLength([1, 2, 4, 8])
    prior = {t: adaptive.expected_tokens("r", t) for t in adaptive.tiers}
    propose(adaptive, "r")
    adaptive.observe("r", [1, 2])            # a, b matched; c (node 4) may still come
    assert {t: adaptive.expected_tokens("r", t) for t in adaptive.tiers} == prior
    adaptive.observe("r", [4, 7])            # c matched, then 7 is no child of c: resolved
    # path nodes 1, 2, 4: a cut to t nodes commits the path nodes below t, plus the bonus
    outcome = {1: 1, 2: 2, 4: 3, 8: 4}
    for t, tokens in outcome.items():
        assert adaptive.expected_tokens("r", t) == pytest.approx(prior[t] + 0.3 * (tokens - prior[t]))


def test_a_walk_that_reaches_a_leaf_resolves_at_once():
    adaptive = AdaptiveDraftLength([1, 8])
    propose(adaptive, "r", ([9, 3], [-1, 0]))
    adaptive.observe("r", [3, 8, 8])
    assert adaptive.expected_tokens("r", 8) == pytest.approx(8 + 0.3 * (2 - 8))


def measured(adaptive: AdaptiveDraftLength, costs: dict[int, float], batch_size: int = 1) -> None:
    for tier, seconds in costs.items():
        adaptive.record_step(batch_size, tier, seconds)


def test_unmeasured_tiers_are_tried_in_order_then_the_best_rate_wins():
    adaptive = AdaptiveDraftLength([1, 4, 8])
    chosen = []
    for _ in range(3):
        tier = adaptive.choose(["r"], [8])
        chosen.append(tier)
        adaptive.record_step(1, tier, {1: 0.05, 4: 0.06, 8: 0.12}[tier])
    assert chosen == [1, 4, 8]
    # prior: every node accepted -> 4 tokens / 0.06 s beats 8 / 0.12 and 1 / 0.05
    assert adaptive.choose(["r"], [8]) == 4


def test_plain_decoding_wins_when_drafts_miss_and_verifying_costs():
    adaptive = AdaptiveDraftLength([1, 4, 8])
    measured(adaptive, {1: 0.05, 4: 0.08, 8: 0.11})
    for _ in range(20):                       # every proposal rejected at the first node
        propose(adaptive, "r")
        adaptive.observe("r", [7])
    assert adaptive.choose(["r"], [8]) == 1
    assert adaptive.choose(["r"], [1]) == 1   # nothing drafted: plain


def test_while_plain_wins_the_bucket_decodes_plainly_until_a_probe_says_drafts_pay():
    adaptive = AdaptiveDraftLength([1, 4])
    batch = [f"r{i}" for i in range(8)]
    measured(adaptive, {1: 0.05, 4: 0.08}, batch_size=8)
    assert not adaptive.should_draft(8)                # a new bucket starts plain (its rate is the reference)
    for rid in batch:
        for _ in range(5):
            propose(adaptive, rid)
            adaptive.observe(rid, [7])
    assert adaptive.choose(batch, [6] * len(batch)) == 1
    assert not adaptive.should_draft(8) and not adaptive.would_draft(8)   # plain mode, no drafting step
    assert not adaptive.should_draft(16) and adaptive.modes.hold == {8: PLAIN_HOLD, 16: PLAIN_HOLD}  # per bucket
    window = adaptive.probe_requests(8)
    assert len(window) == 8 and adaptive.probe_requests(40) != adaptive.probe_requests(40)   # rotates
    adaptive.probe(8, batch, [6] * len(batch))         # drafts still miss: stay plain
    assert not adaptive.should_draft(8)
    chain = ([9, 1, 2, 3], [-1, 0, 1, 2])
    for rid in batch:                                  # probes' shadows start to hit
        for _ in range(10):
            propose(adaptive, rid, chain)
            adaptive.observe(rid, [1, 2, 3, 8])
    adaptive.probe(8, batch[:2], [4, 4])               # held plain for PLAIN_HOLD steps after the episode
    assert not adaptive.would_draft(8)
    hold_out(adaptive, 8)
    adaptive.probe(8, batch[:2], [4, 4])               # a sample of the batch speaks for it
    assert switches(adaptive, 8)
    assert adaptive.choose(batch, [4] * len(batch)) == 4


def hold_out(adaptive: AdaptiveDraftLength, batch_size: int, steps: int = PLAIN_HOLD,
             seconds: float = 0.05) -> None:
    """Plain steps of the bucket, one token per request each, until its hold has passed."""
    for _ in range(steps):
        adaptive.record_step(batch_size, 1, seconds, tokens=batch_size)


def switches(adaptive: AdaptiveDraftLength, batch_size: int) -> bool:
    """After a probe asked to draft: the step already launched ahead decodes plainly and
    no further one is launched; the step after it drafts."""
    return (not adaptive.should_draft(batch_size) and adaptive.would_draft(batch_size)
            and adaptive.should_draft(batch_size))


def test_a_probe_switch_waits_for_the_step_launched_ahead():
    """The engine asks should_draft at a step's start and would_draft before launching the
    next step ahead: a switch must not throw away a step already launched."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.05, 4: 0.06})
    adaptive.modes.plain.add(1)
    adaptive.record_step(1, 1, 0.05, tokens=1)         # a plain step: the rate drafting is judged against
    adaptive.probe(1, ["r"], [4])                      # the prior: every draft node accepted
    assert not adaptive.should_draft(1)                # this step runs the one launched ahead
    assert adaptive.would_draft(1)                     # ... and launches none after it
    assert adaptive.should_draft(1)                    # the next step drafts


def test_a_drafting_episode_below_the_plain_rate_is_stopped_and_the_hold_doubles():
    """Whatever the model expects, drafting that commits fewer tokens per second than
    plain decoding did is stopped after GUARD_STEPS steps; each lost episode (here 0.16 s,
    what 32 plain steps pay back at BYPASS_BUDGET) keeps the bucket plain twice as long (up
    to MAX_PLAIN_HOLD); a won episode resets the hold."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.05, 4: 0.07})             # the prior expects 4 tokens per 0.07 s: draft
    adaptive.modes.plain.add(1)
    hold_out(adaptive, 1)                              # plain: 20 tokens/s realized
    holds = []
    for _ in range(8):
        adaptive.probe(1, ["r"], [4])
        assert switches(adaptive, 1)
        for step in range(GUARD_STEPS):                # drafting realizes 1 token per 0.07 s
            assert adaptive.should_draft(1), step
            assert adaptive.choose(["r"], [4]) == 4
            adaptive.record_step(1, 4, 0.07, tokens=1)
        assert not adaptive.should_draft(1)
        holds.append(adaptive.modes.hold[1])
        adaptive.probe(1, ["r"], [4])
        assert not adaptive.would_draft(1)             # held
        hold_out(adaptive, 1, holds[-1])
    assert holds == [min(PLAIN_HOLD * 2 ** i, MAX_PLAIN_HOLD) for i in range(1, 9)]
    adaptive.probe(1, ["r"], [4])
    assert switches(adaptive, 1)
    for _ in range(3):                                 # this time drafting pays: 3 tokens per 0.06 s
        adaptive.record_step(1, 4, 0.06, tokens=3)
    chain = ([9, 1, 2, 3], [-1, 0, 1, 2])
    for _ in range(20):                                # evidence that drafts miss: the model goes plain
        propose(adaptive, "r", chain)
        adaptive.observe("r", [7])
    assert adaptive.choose(["r"], [4]) == 1
    assert adaptive.modes.hold[1] == PLAIN_HOLD             # the episode won: back to the short hold


def lose_an_episode(adaptive: AdaptiveDraftLength, rid: str) -> None:
    """Batch 1: the bucket drafts for `rid` (the prior expects every node accepted) and
    realizes 1 token per 0.065 s step against plain's 20 tokens/s: the guard stops it."""
    adaptive.probe(1, [rid], [4])
    assert switches(adaptive, 1)
    draft_and_lose(adaptive, rid)


def draft_and_lose(adaptive: AdaptiveDraftLength, rid: str) -> None:
    """A drafting episode of `rid` at batch 1 that the guard stops: 1 token per 0.065 s."""
    for _ in range(GUARD_STEPS):
        tier = adaptive.choose([rid], [4])
        assert tier in (1, 4)   # 1: plain decoding re-priced now and then (it always contends)
        adaptive.record_step(1, tier, 0.065 if tier == 4 else 0.05, tokens=1)
    assert not adaptive.should_draft(1)


def test_a_hold_is_about_the_requests_that_lost_not_the_next_ones():
    """A bucket held plain after an episode that lost keeps the hold for the requests of
    that episode; a probe of a new request (the next conversation at batch 1) may switch
    at once."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.05, 4: 0.065})
    adaptive.modes.plain.add(1)
    hold_out(adaptive, 1)
    lose_an_episode(adaptive, "old")
    assert adaptive.modes.hold[1] == 2 * PLAIN_HOLD
    adaptive.probe(1, ["old"], [4])
    assert not adaptive.would_draft(1)                 # held against the request that lost
    hold_out(adaptive, 1, bypass_wait(0.065, 1, 0.05) + 1)  # the old chat decodes on, plainly (+1: float sums)
    adaptive.probe(1, ["old"], [4])
    assert not adaptive.would_draft(1)
    adaptive.probe(1, ["new"], [4])
    assert switches(adaptive, 1)                       # a new request is not held against
    # a batch judged on a sample: any request of the lost episode keeps the hold
    wide = AdaptiveDraftLength([1, 4])
    measured(wide, {1: 0.05, 4: 0.06}, batch_size=4)
    wide.modes.plain.add(4)
    hold_out(wide, 4)
    wide.probe(4, ["a", "b", "c", "d"], [4] * 4)
    assert switches(wide, 4)
    for _ in range(GUARD_STEPS):
        wide.choose(["a", "b", "c", "d"], [4] * 4)
        wide.record_step(4, 4, 0.06, tokens=4)
    assert not wide.should_draft(4)
    wide.probe(4, ["a", "b", "c", "e"], [4] * 4)
    assert not wide.would_draft(4)
    wide.probe(4, ["a", "e", "f", "g"], [4] * 4)       # one request of the lost episode: still held
    assert not wide.would_draft(4)
    hold_out(wide, 4, bypass_wait(0.06, 4, 0.05, batch_size=4))
    wide.probe(4, ["e", "f", "g", "h"], [4] * 4)       # a batch that has turned over
    assert switches(wide, 4)


def bypass_wait(drafting_seconds: float, tokens: int, plain_seconds: float, batch_size: int = 1,
                budget: float = BYPASS_BUDGET) -> int:
    """Plain steps after a lost GUARD_STEPS-step episode (`tokens` per step) before a probe
    may bypass the hold: until the episode's loss is `budget` of the time since."""
    loss = GUARD_STEPS * (drafting_seconds - tokens * plain_seconds / batch_size)
    return math.ceil(loss / budget / plain_seconds - 1e-9)


def test_after_a_losing_episode_a_bypass_waits_until_the_loss_is_paid_for():
    """Whatever the model expects of new requests, episodes that lose cost at most about
    BYPASS_BUDGET of the bucket's time: a new request's probe waits that long."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.05, 4: 0.065})
    adaptive.modes.plain.add(1)
    hold_out(adaptive, 1)
    lose_an_episode(adaptive, "chat0")
    waits = []
    for i in range(1, 4):                              # each new chat drafts (the prior) and loses
        steps = 0
        while True:
            adaptive.probe(1, [f"chat{i}"], [4])
            if adaptive.would_draft(1):
                break
            hold_out(adaptive, 1, 1)
            steps += 1
        waits.append(steps)
        assert adaptive.should_draft(1)
        draft_and_lose(adaptive, f"chat{i}")
    # 8 steps of 0.065 s for 8 tokens plain decodes in 0.4 s: 0.12 s lost, 1.2 s (24 plain steps) to wait
    assert bypass_wait(0.065, 1, 0.05) == 24
    # 25: float sums of the clock; 23: an episode whose step re-priced plain decoding lost less
    assert all(23 <= wait <= 25 for wait in waits), waits
    assert all(hold > w for hold, w in zip([2 * PLAIN_HOLD, 4 * PLAIN_HOLD, 8 * PLAIN_HOLD], waits))


def test_a_busy_bucket_where_drafts_do_not_pay_stays_plain():
    """ShareGPT first turns at concurrency 64 (H100, 1.5B): new requests arrive every few
    steps and each completed prefill makes the next plain step probe; the probes' newest
    requests are expected (the prior) to match in full, while drafting steps commit 1.6
    tokens per request for 7.3 ms against 64 tokens per 2.6 ms plain. Only a small
    fraction of the steps may draft (before the fix: every few steps a new episode, 266 of 400)."""
    adaptive = AdaptiveDraftLength([1, 8])
    measured(adaptive, {1: 0.0026, 8: 0.0073}, batch_size=64)
    admitted, steps, drafting = 64, 400, 0
    for step in range(steps):
        batch = [f"r{i}" for i in range(admitted - 64, admitted)]
        if adaptive.should_draft(64):
            drafting += adaptive.choose(batch, [8] * 64) > 1
            adaptive.record_step(64, 8, 0.0073, tokens=102)
            continue
        probing = adaptive.probe_due(64)
        adaptive.would_draft(64)
        adaptive.record_step(64, 1, 0.0026, tokens=64)
        if probing:
            adaptive.probe(64, batch[-16:], [8] * 16)
        if step % 3 == 2:                              # a prefill: 16 requests replace 16 that ended
            admitted += 16
            adaptive.admit()
    assert drafting / steps < 0.12, drafting


@pytest.mark.parametrize("name, at_most, at_least", [
    ("chat first turns, concurrency 64", 0.08, 0.0),
    ("chat first turns, concurrency 32", 0.08, 0.0),
    ("repeated turn, concurrency 64", 1.0, 0.85),
    ("repeated turn, concurrency 32", 1.0, 0.85),
])
@pytest.mark.parametrize("ragged", [False, True])
def test_simulated_servers_draft_where_it_pays(name, at_most, at_least, ragged):
    """policy_sim: a server of the policy with H100-like step costs and drafts whose
    matches are known. Chats whose drafts rarely match decode plainly; repeated turns draft
    (the policy of a ragged verify step too, its steps costing the nodes they keep)."""
    profiles, concurrency = SCENARIOS[name]
    result, vs_plain, _ = simulate(profiles(0), concurrency, ragged=ragged)
    assert at_least <= result.drafting_fraction <= at_most, result
    assert vs_plain > (2.0 if at_least else 0.9), vs_plain


@pytest.mark.parametrize("ragged", [False, True])
def test_simulated_batch_1_drafts_for_a_good_request_right_after_a_bad_one(ragged):
    """A chat whose drafts all miss (it drafts first: the prior), then repeated turns whose
    drafts match in full: those draft from their first steps."""
    profiles, concurrency = SCENARIOS["batch 1: a chat that misses, then repeated turns"]
    result, vs_plain, _ = simulate(profiles(0), concurrency, ragged=ragged)
    good = ["r1", "r2", "r3"]   # the first also pays for pricing the tiers at batch 1
    drafted = sum(result.drafting_by_request[rid] for rid in good)
    assert drafted >= 0.8 * sum(result.steps_by_request[rid] for rid in good), result
    assert result.drafting_by_request.get("r0", 0) <= GUARD_STEPS and vs_plain > 1.5


def test_requests_that_finish_their_prefill_are_probed_at_the_next_plain_step():
    adaptive = AdaptiveDraftLength([1, 4])
    adaptive.record_step(64, 1, 0.001)
    adaptive.record_probe(64, 10 * PROBE_BUDGET * 0.001)      # k = 10
    assert adaptive.probe_every(64) == 10
    assert [adaptive.probe_due(64) for _ in range(10)] == [False] * 9 + [True]
    adaptive.admit()                                          # a prefill completed
    # a batch larger than a probe covers: at most every ADMIT_GAP plain steps, then k again
    assert [adaptive.probe_due(64) for _ in range(18)] == [False] * (ADMIT_GAP - 1) + [True] + [False] * 9 + [True]
    adaptive.admit()
    assert [adaptive.probe_due(64) for _ in range(ADMIT_GAP)] == [False] * (ADMIT_GAP - 1) + [True]
    # a batch a probe covers whole probes at the next plain step
    adaptive.record_step(8, 1, 0.001)
    adaptive.record_probe(8, 10 * PROBE_BUDGET * 0.001)
    [adaptive.probe_due(8) for _ in range(3)]
    adaptive.admit()
    assert adaptive.probe_due(8)
    # a floor set by the drafter (proposals that cost forwards) still holds
    adaptive.admit()
    assert [adaptive.probe_due(8, every_at_least=3) for _ in range(3)] == [False, False, True]


def test_a_small_batch_probes_again_in_the_first_steps_after_an_admission():
    """Where a probe covers the whole batch, the 2nd/4th/8th/16th plain steps after an
    admission probe as well (an answer's first tokens rarely match what it copies later);
    past them the bucket's k holds again, and a large batch gets the one probe only (once
    ADMIT_GAP plain steps have passed since its last)."""
    adaptive = AdaptiveDraftLength([1, 4])
    for batch_size in (1, 64):
        adaptive.record_step(batch_size, 1, 0.001)
        adaptive.record_probe(batch_size, 32 * PROBE_BUDGET * 0.001)   # k = 32

    def probed_steps(batch_size: int) -> list[int]:
        due = []
        for step in range(1, 33):
            if adaptive.probe_due(batch_size):
                due.append(step)
            adaptive.record_step(batch_size, 1, 0.001)
        return due

    adaptive.admit()
    assert probed_steps(1) == [1, 2, 4, 8, 16]
    adaptive.admit()
    assert probed_steps(64) == [ADMIT_GAP]


def test_a_small_batch_probes_at_once_when_it_enters_another_bucket():
    """The last requests of a drained wave carry their evidence into a smaller bucket: its
    first plain step probes them, whatever that bucket's k; large buckets keep their k."""
    adaptive = AdaptiveDraftLength([1, 4])
    for batch_size in (2, 8, 32, 64):
        adaptive.record_step(batch_size, 1, 0.001)
        adaptive.record_probe(batch_size, 32 * PROBE_BUDGET * 0.001)   # k = 32
    adaptive.record_step(8, 4, 0.002)             # the wave drafts at 8 ...
    assert adaptive.probe_due(2)                  # ... two requests are left: probed at once
    adaptive.record_step(2, 1, 0.001)
    assert not any(adaptive.probe_due(2) for _ in range(10))   # then every k-th step again
    adaptive.record_step(64, 4, 0.002)
    assert not adaptive.probe_due(32)             # a large bucket entered: no extra probe


def test_a_probe_switches_back_only_with_a_margin():
    """Drafting expected to win by less than SWITCH_MARGIN keeps a plain bucket plain (no
    step-by-step alternation between the modes)."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.050, 4: 0.090}, batch_size=1)
    chain = ([9, 1, 2, 3], [-1, 0, 1, 2])
    for _ in range(30):                                # 2 tokens per 0.09 s tier-4 step: 1.11x plain
        propose(adaptive, "r", chain)
        adaptive.observe("r", [1, 8])
    adaptive.modes.plain.add(1)                             # the bucket decodes plainly
    rate_4 = adaptive.expected_tokens("r", 4) / 0.090
    assert 1 / 0.05 < rate_4 < SWITCH_MARGIN / 0.05
    adaptive.probe(1, ["r"], [4])
    assert not adaptive.would_draft(1) and not adaptive.should_draft(1)


def overshooting_policy(optimism: float | None) -> AdaptiveDraftLength:
    """Bucket 1 held plain at 0.05 s a step (1 token), tier 4 priced at 0.12 s and expected to
    commit 4 tokens: 1.67x plain, above SWITCH_MARGIN; `optimism`: its drafting record."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {4: 0.120})
    assert not adaptive.should_draft(1)                # a new bucket starts plain
    for _ in range(4):
        adaptive.record_step(1, 1, 0.050, tokens=1)    # plain mode's price and realized rate
    chain = ([9, 1, 2, 3], [-1, 0, 1, 2])
    for _ in range(30):
        propose(adaptive, "old", chain)
        adaptive.observe("old", [1, 2, 3, 8])
    if optimism is not None:
        adaptive.optimism[1] = optimism
    return adaptive


@pytest.mark.parametrize("optimism, switches", [(None, True), (1.0, True), (0.5, True), (1.3, True), (1.6, False)])
def test_a_probe_asks_more_of_a_bucket_whose_drafting_choices_overshot(optimism, switches):
    adaptive = overshooting_policy(optimism)
    assert adaptive.expected_tokens("", 4) / 0.120 == pytest.approx(4 / 0.120)   # 1.67x plain's 20 tok/s
    propose(adaptive, "new", ([9, 1, 2, 3], [-1, 0, 1, 2]))
    adaptive.probe(1, ["new"], [4])
    assert adaptive.would_draft(1) is switches


def drafting_record(tokens_per_step: list[int], seconds_per_step: list[float]) -> AdaptiveDraftLength:
    """overshooting_policy's bucket drafting at tier 4 (priced 0.12 s, 4 tokens expected) for
    steps that commit and take what the lists say."""
    adaptive = overshooting_policy(None)
    for tokens, seconds in zip(tokens_per_step, seconds_per_step):
        assert adaptive.choose(["old"], [4]) == 4
        adaptive.record_step(1, 4, seconds, tokens=tokens)
    return adaptive


def test_a_buckets_optimism_is_its_drafting_steps_expected_tokens_over_committed():
    steps = OPTIMISM_WINDOW + 2
    half = drafting_record([2] * steps, [0.120] * steps)
    assert half.optimism[1] == pytest.approx(2.0)   # 33.3 tok/s expected, 16.7 realized
    # a step that commits nothing counts: 4 * 8 expected, 2 * 7 committed
    assert drafting_record([2, 2, 2, 0, 2, 2, 2, 2], [0.120] * 8).optimism[1] == pytest.approx(32 / 14)


def test_a_copy_edits_few_long_accepts_are_no_overshoot():
    """Most steps of a copy-edit commit one token and one in several commits many: a model
    whose mean is right is not optimistic (a median of per-step ratios read 4 here)."""
    tokens = [1, 1, 1, 1, 1, 1, 1, 25] * 2
    assert drafting_record(tokens, [0.120] * len(tokens)).optimism[1] == pytest.approx(1.0)


def test_a_stalled_step_is_no_overshoot():
    tokens = [4] * OPTIMISM_WINDOW
    stalled = [0.120] * (OPTIMISM_WINDOW - 1) + [1.2]
    assert drafting_record(tokens, stalled).optimism[1] == pytest.approx(1.0)


def test_evidence_classes_tell_weak_matches_from_strong_ones():
    """Per class (NGRAM: matched suffix length): one-token matches that never pay decode
    plainly, long matches that do get the largest draft, within the same request."""
    adaptive = AdaptiveDraftLength([1, 8])
    measured(adaptive, {1: 0.04, 8: 0.08})
    chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
    for _ in range(10):
        adaptive.record_proposals(["r"], TreeProposal.from_lists([chain]), [8], keys=[1])
        adaptive.observe("r", [99])                    # weak match: rejected at once
        adaptive.record_proposals(["r"], TreeProposal.from_lists([chain]), [8], keys=[5])
        adaptive.observe("r", [1, 2, 3, 4, 5, 6, 7, 98])
    assert adaptive.choose(["r"], [8], keys=[1]) == 1
    assert adaptive.choose(["r"], [8], keys=[5]) == 8
    assert adaptive.expected_tokens("r", 8, key=5) > 6 > 1.5 > adaptive.expected_tokens("r", 8, key=1)


def test_long_accepted_paths_pick_the_largest_tier():
    adaptive = AdaptiveDraftLength([1, 2, 4, 8])
    measured(adaptive, {1: 0.05, 2: 0.06, 4: 0.08, 8: 0.11})
    chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
    for _ in range(20):
        propose(adaptive, "r", chain)
        adaptive.observe("r", [1, 2, 3, 4, 5, 6, 7])
    assert adaptive.choose(["r"], [8]) == 8


@pytest.mark.parametrize("plain_cost", [0.016, 0.05])
def test_costs_are_per_batch_bucket_and_contenders_refreshed(plain_cost):
    """Tier 4 commits 4 tokens (the prior) for 0.06 s. Plain decoding is re-measured now and
    then, whether it is a close contender (0.016 s) or far behind (0.05 s): it is what
    drafting must beat, and one slow step must not price it for good."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: plain_cost, 4: 0.06}, batch_size=1)
    assert adaptive.choose(["a", "b", "c"], [4, 4, 4]) == 1   # bucket 4 not measured yet: try 1 first
    refreshed = []
    for step in range(2 * REFRESH_EVERY):
        tier = adaptive.choose(["r"], [4])
        refreshed.append(tier)
        adaptive.record_step(1, tier, plain_cost if tier == 1 else 0.06)
    assert 1 <= refreshed.count(1) <= 4 and refreshed.count(4) > REFRESH_EVERY


def test_probes_come_every_kth_plain_step_with_k_from_measured_costs():
    """A probe's host time is not hidden where plain steps are short: a bucket probes every
    k-th plain step, k the smallest keeping probes within PROBE_BUDGET of a plain step."""
    adaptive = AdaptiveDraftLength([1, 4])
    assert all(adaptive.probe_due(1) for _ in range(3))      # nothing timed yet: every plain step
    adaptive.record_step(1, 1, 0.001)                         # a plain step: 1 ms
    adaptive.record_probe(1, 2.5 * PROBE_BUDGET * 0.001)      # a probe: 2.5 budgets
    assert adaptive.probe_every(1) == 3
    assert [adaptive.probe_due(1) for _ in range(9)] == [False, False, True] * 3
    assert adaptive.probe_due(64) and adaptive.probe_every(64) == 1   # per bucket
    # a drafter whose proposals cost forwards keeps its own floor
    assert [adaptive.probe_due(1, every_at_least=8) for _ in range(16)] == ([False] * 7 + [True]) * 2
    adaptive.record_probe(1, 1.0)                             # dear probes: capped, the policy keeps looking
    assert adaptive.probe_every(1) == MAX_PROBE_EVERY
    # ... at a drafter's own cap where its probes cost forwards (EagleDrafter: every 128th plain step)
    assert [adaptive.probe_due(1, every_at_least=16, every_at_most=128) for _ in range(256)] == \
        ([False] * 127 + [True]) * 2
    assert [adaptive.probe_due(1) for _ in range(MAX_PROBE_EVERY)][-1]   # the default cap is unchanged
    cheap = AdaptiveDraftLength([1, 4])
    cheap.record_step(8, 1, 0.001)
    cheap.record_probe(8, 0.1 * PROBE_BUDGET * 0.001)
    assert cheap.probe_every(8) == 1 and all(cheap.probe_due(8) for _ in range(5))


def test_costly_probes_back_off_while_they_keep_the_bucket_plain():
    """A model drafter's probes (forwards and a sync) that keep finding drafting not worth it in
    a small bucket come half as often after each, down to an eighth, and admissions stop
    probing from the second; a probe that switches the bucket resets both. n-gram probes and
    large buckets keep their k."""
    def gaps(schedule, count, **kwargs):   # plain steps between the next `count` probes
        found, waited = [], 0
        while len(found) < count:
            waited += 1
            if schedule.due(1, **kwargs):
                found.append(waited)
                waited = 0
        return found

    costly = {"every_at_least": 16, "every_at_most": 128}
    schedule = ProbeSchedule()
    schedule.record(1, 1.0, 0.001)            # dear probes: the budget alone would wait ~10^5 steps
    assert gaps(schedule, 1, **costly) == [128]
    found = []
    for _ in range(5):
        schedule.verdict(1, switched=False)
        found += gaps(schedule, 1, **costly)
    assert found == [256, 512, 1024, 1024, 1024]
    schedule.admit()                          # kept plain twice and more: admissions wait their turn
    assert not schedule.due(1, **costly)
    schedule.verdict(1, switched=True)        # a probe that switched: the cap and admissions are back
    schedule.admit()
    assert [schedule.due(1, **costly) for _ in range(15)].count(True) == 1   # as soon as every_at_least allows
    assert gaps(schedule, 1, **costly) == [128]
    cheap = ProbeSchedule()
    cheap.record(1, 1.0, 0.001)
    for _ in range(4):
        cheap.verdict(1, switched=False)
    assert gaps(cheap, 2) == [MAX_PROBE_EVERY] * 2
    cheap.admit()
    assert cheap.due(1)
    large = ProbeSchedule()                   # a bucket a probe does not cover whole keeps its cap
    large.record(64, 1.0, 0.001)
    for _ in range(4):
        large.verdict(64, switched=False)
    assert [large.due(64, **costly) for _ in range(256)].count(True) == 2


def test_a_probe_put_off_runs_at_the_next_plain_step():
    """A probe due on a step with nothing launched ahead is put off (its host time would add
    to a step the GPU waits for): the bucket's next plain step probes, then k steps again."""
    adaptive = AdaptiveDraftLength([1, 4])
    adaptive.record_step(64, 1, 0.001)
    adaptive.record_probe(64, 3 * PROBE_BUDGET * 0.001)      # k = 3
    assert [adaptive.probe_due(64) for _ in range(3)] == [False, False, True]
    adaptive.put_off_probe(64)
    assert [adaptive.probe_due(64) for _ in range(4)] == [True, False, False, True]
    assert [adaptive.probe_due(8) for _ in range(2)] == [True, True]   # per bucket: 8's k is still 1


def test_tiers_are_the_graph_sizes_or_powers_of_two():
    assert tiers_for(16, [1, 4, 8, 16]) == [1, 4, 8, 16]
    assert tiers_for(8, [1, 4, 8, 16]) == [1, 4, 8]
    assert tiers_for(6, None) == [1, 2, 4, 6]


# ---- the engine ----
@pytest.fixture(scope="module")
def smol(smollm2_path, smollm2_checkpoint):
    engines = SmolEngines(smollm2_path, smollm2_checkpoint)
    yield engines
    engines.close()


def test_adaptive_engine_equals_plain_and_switches_draft_sizes(smol):
    from specserve.bench.prompts import SAMPLE_PROMPTS
    params = {"temperature": 0, "max_new_tokens": 48}
    plain = smol.make()
    prompts = [plain.tokenizer(p).input_ids for p in [CODE_PROMPT, *SAMPLE_PROMPTS[1:4]]]
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    smol.close(plain)
    engine = smol.make(**ngram_args(8, adaptive=True))
    for _ in range(2):  # the second round sees tiers already priced
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert got == expected
    solo = engine.generate(input_ids=prompts[0], sampling_params=params)
    assert solo["output_ids"] == expected[0]
    used = {tier: steps for tier, steps in engine.core.adaptive.steps_per_tier.items() if steps}
    assert len(used) >= 2 and 8 in used, used
    wait_until_all_kv_is_free(engine)
    smol.close(engine)


def test_a_drafter_behind_on_its_indexing_puts_the_probe_off():
    asked = []
    adaptive = SimpleNamespace(probe_due=lambda batch_size, every, most: asked.append(batch_size) or True)
    drafter = ProposalHints()   # a drafter whose background work is far behind
    drafter.ready_to_probe, drafter.probe_every, drafter.probe_every_at_most = (lambda: False), 1, None
    planner = SimpleNamespace(adaptive=adaptive, drafter=drafter)
    assert not DraftPlanner.probe_due(planner, ["a", "b"])
    assert asked == []   # the probe counters did not move: the first step the drafter is ready for probes
    planner.drafter.ready_to_probe = lambda: True
    assert DraftPlanner.probe_due(planner, ["a", "b"]) and asked == [2]


def test_plain_decoding_is_priced_by_the_steps_plain_mode_runs():
    costs = StepCosts([1, 4, 8])
    costs.record(64, 1, 0.0035, steady=False)   # a plain step inside a drafting episode: a makeshift price
    assert costs.seconds[(64, 1)] == 0.0035
    for seconds in (0.0019, 0.0020, 0.0018):     # overlapped plain steps replace it
        costs.record(64, 1, seconds)
    assert costs.seconds[(64, 1)] == 0.0019
    measured = costs.measured_at[(64, 1)]
    costs.record(64, 1, 0.0044, steady=False)    # a probing step: counted, not priced
    assert costs.seconds[(64, 1)] == 0.0019 and costs.measured_at[(64, 1)] == measured
    assert costs.steps(64) == 5


def test_makeshift_steps_that_cost_the_price_keep_it_fresh():
    """Where the batch changes nearly every step, a level is seldom priced by a steady step:
    makeshift steps that cost about its price confirm it, and it does not go stale; one far
    from the price confirms nothing (a makeshift step may carry a catch-up, or show the
    price too high)."""
    def stale_after(makeshift_seconds: float) -> bool:
        costs = StepCosts([1, 16])
        costs.record(32, 1, 0.0022)
        for _ in range(2):                       # two steady steps: fewer than MIN_SAMPLES
            costs.record(32, 16, 0.0067)
        for _ in range(3):
            costs.record(32, 16, makeshift_seconds, steady=False)
        for _ in range(RECHECK_GAP):
            costs.record(32, 1, 0.0022)
        assert costs.seconds[(32, 16)] == 0.0067  # a makeshift step never moves a steady price
        return costs.stale(32, 16)
    assert not stale_after(0.0072)
    assert stale_after(0.0040) and stale_after(0.0120)


def test_a_bucket_priced_by_overlapped_plain_steps_stays_plain_where_drafts_break_even():
    """H100 trace (0.5B, ShareGPT second turns at 64): drafting steps of 8 nodes ~5.4 ms;
    plain steps 1.9 ms overlapped, 3.3-4.4 ms when they probed or followed a drafting step.
    Priced by the slow ones too, drafting looked faster than plain where it lost end to end."""
    def choice(slow_steps_price_plain: bool) -> int:
        adaptive = AdaptiveDraftLength([1, 8])
        for _ in range(8):
            adaptive.record_step(64, 1, 0.0019, tokens=64)
            adaptive.record_step(64, 1, 0.0035, tokens=64, steady=slow_steps_price_plain)
            adaptive.record_step(64, 8, 0.0054, tokens=128)
        rids = [f"r{i}" for i in range(64)]
        chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
        for _ in range(20):   # a draft of 8 commits 2 tokens: 64 * 2 / 5.4 ms = 23.7k tok/s
            for rid in rids:
                propose(adaptive, rid, chain)
                adaptive.observe(rid, [1, 99])
        return adaptive.choose(rids, [8] * 64)
    assert choice(slow_steps_price_plain=True) == 8    # plain at 3.5 ms: 18.3k tok/s
    assert choice(slow_steps_price_plain=False) == 1   # plain at 1.9 ms: 33.7k tok/s


def test_realized_rates_are_per_request_so_a_filling_batch_does_not_flatter_drafting():
    """H100 (0.5B, ShareGPT second turns at 32): the plain reference was taken while the
    batch filled (~20 requests) and a drafting episode at 32 requests realized more tokens
    per second than that while each request lost (2.2 tokens per 5.0 ms against 1 per
    1.55 ms): judged per request, the guard stops it."""
    adaptive = AdaptiveDraftLength([1, 8])
    measured(adaptive, {1: 0.00155, 8: 0.005}, batch_size=32)
    adaptive.modes.plain.add(32)
    hold_out(adaptive, 20, seconds=0.00155)            # 12.9k tok/s; 645 tok/s a request
    rids = [f"r{i}" for i in range(32)]
    adaptive.probe(32, rids, [8] * 32)                 # the prior: every node accepted
    assert switches(adaptive, 32)
    for _ in range(GUARD_STEPS):                       # 14.1k tok/s; 440 tok/s a request
        adaptive.choose(rids, [8] * 32)
        adaptive.record_step(32, 8, 0.005, tokens=70)
    assert not adaptive.should_draft(32)


def drafting_at_batch_1() -> AdaptiveDraftLength:
    """Batch 1 after a probe of request "r" switched it to drafting: plain decoding priced at
    0.05 s a step (20 tokens/s realized), drafts of 4 nodes at 0.06 s."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.05, 4: 0.06})
    adaptive.modes.plain.add(1)
    hold_out(adaptive, 1)
    adaptive.probe(1, ["r"], [4])
    assert switches(adaptive, 1)
    return adaptive


def test_the_guard_judges_an_episode_by_its_recent_steps():
    """An episode that won at first (a warm-up's prompts, or drafts that matched) is stopped
    once its last GUARD_WINDOW steps fall below the plain rate."""
    adaptive = drafting_at_batch_1()
    for _ in range(40):                                # 4 tokens per 0.06 s
        adaptive.choose(["r"], [4])
        adaptive.record_step(1, 4, 0.06, tokens=4)
    assert adaptive.should_draft(1)
    losing = 0
    while adaptive.should_draft(1):                    # now 1 token per 0.06 s: whole episode still ahead
        adaptive.choose(["r"], [4])
        adaptive.record_step(1, 4, 0.06, tokens=1)
        losing += 1
    assert losing <= GUARD_WINDOW


def test_a_bucket_drafting_without_a_steady_plain_price_tries_plain_decoding():
    """A bucket whose plain steps were all makeshift (not launched ahead: prefills broke
    every chain) prices plain decoding at ~2x its cost: after GUARD_STEPS drafting steps it
    decodes plainly for a trial, and probes do not switch it back before a steady plain
    step has priced plain decoding."""
    adaptive = AdaptiveDraftLength([1, 8])
    rids = [f"r{i}" for i in range(32)]
    adaptive.record_step(32, 1, 0.003, tokens=32, steady=False)
    adaptive.record_step(32, 8, 0.005, tokens=70)
    adaptive.modes.plain.discard(32)                   # drafting (a bypass of its first hold)
    adaptive.modes.hold[32] = PLAIN_HOLD
    chosen = []
    while not chosen or chosen[-1] > 1:                # drafting looks better: 14k tok/s against 10.7k
        chosen.append(adaptive.choose(rids, [8] * 32))
        adaptive.record_step(32, chosen[-1], 0.005 if chosen[-1] > 1 else 0.003, tokens=70, steady=chosen[-1] > 1)
    assert len(chosen) == GUARD_STEPS - 1 and not adaptive.should_draft(32)   # (+ its first step, above)
    assert adaptive.modes.hold[32] == PLAIN_HOLD            # a trial, not a lost episode
    for _ in range(PLAIN_HOLD):                        # past its hold, but only makeshift steps
        adaptive.record_step(32, 1, 0.003, tokens=32, steady=False)
    adaptive.probe(32, rids, [8] * 32)
    assert not adaptive.would_draft(32)
    adaptive.record_step(32, 1, 0.0015, tokens=32)     # a steady plain step prices plain decoding
    adaptive.probe(32, rids, [8] * 32)                 # the prior (8 tokens per 5 ms) wins against it
    assert switches(adaptive, 32)


def test_a_stale_drafting_price_is_re_measured_when_drafting_may_win():
    """A plain bucket's drafting price from one slow step (often a bucket's first) keeps it
    plain where drafts match (H100, 0.5B, code-rename at 64: 0.92x where it drafted at 1.24x):
    a probe re-prices such a tier when, at the stale price, drafting reaches EXPLORE_RATIO of
    plain; far below that it does not."""
    def switched(tokens_per_draft: int) -> bool:
        adaptive = AdaptiveDraftLength([1, 8])
        adaptive.record_step(64, 8, 0.020, tokens=64 * tokens_per_draft)   # one slow first step
        adaptive.modes.plain.add(64)
        hold_out(adaptive, 64, RECHECK_GAP, seconds=0.002)                 # 32k tok/s
        rids = [f"r{i}" for i in range(16)]
        chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
        for _ in range(20):
            for rid in rids:
                propose(adaptive, rid, chain)
                adaptive.observe(rid, [1, 2, 3, 4, 5, 6, 7][:tokens_per_draft - 1] + [99])
        adaptive.probe(64, rids, [8] * 16)
        if not switches(adaptive, 64):
            return False
        assert adaptive.choose([f"r{i}" for i in range(64)], [8] * 64) == 8   # re-priced first
        return True
    assert switched(8)        # 64 * 8 / 20 ms = 25.6k tok/s: 0.8 of plain's, at a stale price
    assert not switched(2)    # 6.4k tok/s


def test_a_makeshift_re_pricing_step_is_followed_by_one_that_prices():
    """A re-pricing episode's first step is launched when the scheduler asks for it
    (makeshift): it does not move a steady price, so the level stayed stale and a whole
    episode re-priced it again every few dozen steps. The step after it, launched ahead,
    re-prices it once more; its steady price ends the re-pricing for RECHECK_GAP steps."""
    adaptive = AdaptiveDraftLength([1, 8])
    for _ in range(3):
        adaptive.record_step(64, 8, 0.020, tokens=64 * 8)                # a steady price, taken long ago
    adaptive.modes.plain.add(64)
    hold_out(adaptive, 64, STALE_AFTER + 1, seconds=0.002)               # 32k tok/s: the price is stale
    rids = [f"r{i}" for i in range(64)]
    chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
    for _ in range(20):
        for rid in rids[:16]:
            propose(adaptive, rid, chain)
            adaptive.observe(rid, [1, 2, 3, 4, 5, 6, 7, 99])
    adaptive.probe(64, rids[:16], [8] * 16)
    assert switches(adaptive, 64)
    assert adaptive.costs.stale(64, 8)
    assert adaptive.choose(rids, [8] * 64) == 8                          # the re-pricing step ...
    adaptive.record_step(64, 8, 0.004, tokens=64 * 8, steady=False)      # ... makeshift: no price
    assert adaptive.costs.stale(64, 8) and adaptive.costs.price(64, 8) == 0.020
    # once more, launched ahead (at the stale price drafting makes 0.8 of plain's rate: a choice
    # by the price alone would end the episode here, and the level would stay stale)
    assert adaptive.choose(rids, [8] * 64) == 8
    adaptive.record_step(64, 8, 0.004, tokens=64 * 8)
    assert not adaptive.costs.stale(64, 8) and adaptive.costs.measured_at[(64, 8)] == adaptive.costs.steps(64)
    assert adaptive._explore == {}                                       # nothing left to re-price


def test_one_stall_does_not_stop_an_episode_that_wins():
    adaptive = drafting_at_batch_1()
    for step in range(GUARD_STEPS):                    # 3 tokens per 0.06 s, one step stalled
        adaptive.choose(["r"], [4])
        adaptive.record_step(1, 4, 1.0 if step == 3 else 0.06, tokens=3)   # 14.8 tokens/s with it
    assert adaptive.should_draft(1)


def test_an_exploration_that_drafts_no_step_is_no_lost_episode():
    adaptive = drafting_at_batch_1()
    chain = ([9, 1, 2, 3], [-1, 0, 1, 2])
    for _ in range(20):                                # the drafts miss: the first choice is plain
        propose(adaptive, "r", chain)
        adaptive.observe("r", [7])
    assert adaptive.choose(["r"], [4]) == 1
    assert adaptive.modes.hold[1] == PLAIN_HOLD


def plain_code_answer(smol) -> tuple[list[int], dict, list[int]]:
    """(CODE_PROMPT's ids, greedy params, plain decoding's 24 tokens), from an engine freed after."""
    params = {"temperature": 0, "max_new_tokens": 24}
    plain = smol.make()
    prompt = plain.tokenizer(CODE_PROMPT).input_ids
    expected = plain.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    smol.close(plain)
    return prompt, params, expected


def test_a_drafting_bucket_decodes_plainly_while_the_drafter_indexes(smol):
    """A drafting step whose proposals would wait for the drafter's indexing (a batch of
    new prompts) runs as a plain step instead; the output is plain decoding's."""
    prompt, params, expected = plain_code_answer(smol)
    engine = smol.make(**ngram_args(8, adaptive=True))
    adaptive, drafter = engine.core.adaptive, engine.core.drafter
    adaptive.should_draft = lambda batch_size: True    # the bucket drafts
    drafter.ready_to_draft = lambda: False             # ... but the indexing is far behind
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected
    assert {t for t, n in adaptive.steps_per_tier.items() if n} == {1}
    wait_until_all_kv_is_free(engine)
    smol.close(engine)


def test_plain_steps_of_a_drafting_bucket_launch_ahead_while_the_drafter_indexes(smol):
    """Those plain steps run on the overlap schedule (forced on here, as on a GPU): each is
    launched before the last one's tokens are read, and the step in flight when the
    drafter catches up is read, not thrown away; then the bucket drafts. Output: plain's."""
    from tests.test_overlap import overlapped
    prompt, params, expected = plain_code_answer(smol)
    engine = smol.make(**ngram_args(8, adaptive=True))
    core, adaptive = engine.core, engine.core.adaptive
    used = overlapped(engine)
    adaptive.should_draft = adaptive.would_draft = lambda batch_size: True   # the bucket drafts
    behind = iter([False] * 12)                        # ... but the indexing is behind for a few steps
    core.drafter.ready_to_draft = lambda: next(behind, True)
    thrown_away, drop = [], core.ahead.drop
    core.ahead.drop = lambda: (thrown_away.append(core.overlap.ahead is not None), drop())[1]
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected
    assert used["ahead"] >= 4 and not any(thrown_away)
    assert any(n for t, n in adaptive.steps_per_tier.items() if t > 1)   # it drafted once caught up
    wait_until_all_kv_is_free(engine)
    smol.close(engine)


def test_an_unpriced_tier_costs_at_least_plain_plus_what_drafting_adds_elsewhere():
    """StepCosts.floor: bucket 32 adds 3 ms to its 2 ms plain step at tier 4; bucket 16 (plain
    1.8 ms) is not priced at tier 4: at least 1.8 + 3 * (16 / 2) / 32 ms; bucket 64, at least
    its plain price plus all 3 ms; tier 2 at least bucket 32's tier 4 in proportion to the
    draft rows each verifies (8 x 1 against 32 x 3). Bucket 64's tier 8, priced at 8.8 ms over
    plain, floors its tier 4 by the same rule (64 x 3 against 64 x 7), above bucket 32's 3 ms."""
    costs = StepCosts([1, 2, 4, 8])
    costs.record(32, 1, 0.002)
    costs.record(32, 4, 0.005)
    costs.record(16, 1, 0.0018)
    costs.record(64, 1, 0.0026)
    assert costs.floor(16, 4) == pytest.approx(0.0018 + 0.003 / 4)
    assert costs.floor(16, 8) == pytest.approx(0.0018 + 0.003 / 4)
    assert costs.floor(64, 4) == pytest.approx(0.0026 + 0.003)
    assert costs.floor(16, 2) == pytest.approx(0.0018 + 0.003 * 8 / 96)
    assert costs.floor(8, 4) is None                   # plain decoding unpriced there
    costs.record(64, 8, 0.0114)
    assert costs.floor(64, 4) == pytest.approx(0.0026 + 0.0088 * 3 / 7)
    assert costs.floor(64, 2) == pytest.approx(0.0026 + 0.003)   # a seventh of 8.8 ms: the fixed part is more


def draining_batch_policy(matched: list[int]) -> AdaptiveDraftLength:
    """Bucket 32 priced (plain 2 ms, tier 4 5 ms) and drafting for 16 requests whose 4-node
    chains matched `matched` nodes; the batch has drained to bucket 16, plain-priced at 1.8 ms
    and held plain, its drafting tiers unpriced."""
    adaptive = AdaptiveDraftLength([1, 4])
    measured(adaptive, {1: 0.002, 4: 0.005}, batch_size=32)
    chain, tokens = ([9, 1, 2, 3], [-1, 0, 1, 2]), [1, 2, 3]
    for _ in range(30):
        for i, match in enumerate(matched):
            propose(adaptive, f"r{i}", chain)
            adaptive.observe(f"r{i}", tokens[:match] + [8])
    assert not adaptive.should_draft(16)               # a new bucket starts plain
    for _ in range(4):
        adaptive.record_step(16, 1, 0.0018, tokens=16)
    adaptive.modes.plain_until[16] = 0                 # its hold has passed
    return adaptive


@pytest.mark.parametrize("matched, switches", [([0] * 14 + [1, 2], False), ([3] * 16, True)])
def test_a_probe_prices_a_bucket_by_drafting_only_where_drafting_may_win(matched, switches):
    """Chats whose chains commit ~1.2 tokens cannot beat 1.8 ms plain steps at tier 4, whose
    step costs at least 1.8 + 3 / 4 ms: no drafting step prices it (H200, 1.5B, ShareGPT
    second turns at 32: ~40% of the drafting steps priced the buckets a draining batch
    passed through). Chains that match in full may win: drafting prices the tier."""
    adaptive = draining_batch_policy(matched)
    adaptive.probe(16, [f"r{i}" for i in range(16)], [4] * 16)
    assert adaptive.would_draft(16) is switches


def test_a_pricing_episode_stops_when_what_is_left_to_price_cannot_win():
    """A drafting step at an unpriced tier (the first bucket is priced tier by tier) runs
    only while that tier may win at its floor price."""
    adaptive = draining_batch_policy([0] * 14 + [1, 2])
    adaptive.modes.plain.discard(16)                   # drafting, as after a probe's switch
    assert adaptive.choose([f"r{i}" for i in range(16)], [4] * 16) == 1
    assert not adaptive.should_draft(16)


def test_a_probe_that_costs_forwards_is_not_pulled_forward_by_a_large_batchs_admissions():
    """A model drafter's probe (every_at_least > 1) costs a head catch-up: a small batch still
    probes its new requests once they are due, a large one keeps its k (prefills complete there
    every few steps, and each admission made a probe every_at_least steps)."""
    adaptive = AdaptiveDraftLength([1, 4])
    for batch_size in (1, 64):
        adaptive.record_step(batch_size, 1, 0.001)
        adaptive.record_probe(batch_size, 64 * PROBE_BUDGET * 0.001)   # k = 64

    def probed_steps(batch_size: int, admit: bool) -> list[int]:
        due = []
        for step in range(1, 65):
            if admit:
                adaptive.admit()   # a prefill completes before every step
            if adaptive.probe_due(batch_size, every_at_least=16, every_at_most=128):
                due.append(step)
            adaptive.record_step(batch_size, 1, 0.001)
        return due

    assert probed_steps(64, admit=False) == [64]
    assert probed_steps(64, admit=True) == [64]          # was [16, 32, 48, 64]
    assert probed_steps(1, admit=False) == [64]
    assert probed_steps(1, admit=True) == [16, 32, 48, 64]   # new requests, probed at the floor
    adaptive.admit()
    assert [adaptive.probe_due(64) for _ in range(ADMIT_GAP)][-1]   # a cheap probe still takes admissions


def test_a_probes_verdict_goes_to_the_debug_log_with_its_rates(caplog, monkeypatch):
    """Why a bucket stays plain: each tier's expected rate, price and tokens a request, at most
    once per DECISION_LOG_INTERVAL_S per bucket."""
    from specserve.speculative.adaptive import policy as adaptive_module
    adaptive = AdaptiveDraftLength([1, 4])
    batch = [f"r{i}" for i in range(8)]
    measured(adaptive, {1: 0.05, 4: 0.08}, batch_size=8)
    for rid in batch:
        for _ in range(5):
            propose(adaptive, rid)
            adaptive.observe(rid, [7])              # every draft missed
    assert adaptive.choose(batch, [6] * len(batch)) == 1
    hold_out(adaptive, 8)
    with caplog.at_level("DEBUG", logger="specserve"):
        adaptive.probe(8, batch, [6] * len(batch))
        adaptive.probe(8, batch, [6] * len(batch))   # within the interval: not logged again
        lines = [r.getMessage() for r in caplog.records if "speculative policy" in r.getMessage()]
        assert len(lines) == 1
        assert "batch 8 (bucket 8)" in lines[0] and lines[0].endswith("stays plain")
        assert "1: 160 tok/s (50.00 ms a step, 1.00 tokens a request)" in lines[0]   # 8 tokens / 50 ms
        assert "4: " in lines[0] and "80.00 ms a step" in lines[0]
        monkeypatch.setattr(adaptive_module, "DECISION_LOG_INTERVAL_S", 0.0)
        adaptive.probe(8, batch, [6] * len(batch))
        assert len([r for r in caplog.records if "speculative policy" in r.getMessage()]) == 2
    assert not adaptive.should_draft(8)
