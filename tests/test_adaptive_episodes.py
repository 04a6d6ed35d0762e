"""The adaptive policy after a drafting episode: one that won leaves its bucket open and a
small batch probes the plain steps right after it; what the probes that started episodes
expected against what the episodes realized raises the switch margin; a large batch's
admission probes back off while they keep it plain."""
from __future__ import annotations

import pytest

from lab.policy_sim import SCENARIOS, simulate
from lab.policy_sim_b1 import GREEDY, SAMPLED, timed_cell
from specserve.bench.policy_trace import PolicyTrace
from specserve.speculative.adaptive.draft_cuts import PLAIN
from specserve.speculative.adaptive.listener import PolicyListener
from specserve.speculative.adaptive.modes import (BYPASS_BUDGET, EPISODE_WINDOW, GUARD_STEPS, MAX_PLAIN_HOLD,
                                                  OVERSHOOT_EVIDENCE, BucketModes)
from specserve.speculative.adaptive.policy import MAX_OPTIMISM, PLAIN_HOLD, SWITCH_MARGIN, AdaptiveDraftLength
from specserve.speculative.adaptive.probes import (
    ADMIT_BACKOFF_DOUBLINGS, ADMIT_GAP, REOPEN_FOLLOW_UPS, ProbeSchedule)
from specserve.verify.tree import TreeProposal

CHAIN = ([9, 1, 2, 3], [-1, 0, 1, 2])


def propose(adaptive: AdaptiveDraftLength, rid: str) -> None:
    adaptive.record_proposals([rid], TreeProposal.from_lists([CHAIN]), [len(CHAIN[0])])


def drafting_bucket(tokens_per_step: int, listener: PolicyListener | None = None) -> AdaptiveDraftLength:
    """Batch 1, plain steps of 0.05 s (20 tokens/s realized), then a drafting episode of
    three 0.06-s tier-4 steps committing `tokens_per_step` each, which then sees drafts that
    miss: its choice goes plain and ends the episode. `listener` hears it all."""
    adaptive = AdaptiveDraftLength([1, 4])
    adaptive.listen(listener)
    adaptive.record_step(1, 4, 0.06)
    assert not adaptive.should_draft(1)                    # a new bucket starts plain
    for _ in range(PLAIN_HOLD):
        adaptive.record_step(1, 1, 0.05, tokens=1)
    adaptive.probe(1, ["r"], [4])                          # the prior: every node accepted
    assert not adaptive.should_draft(1) and adaptive.would_draft(1) and adaptive.should_draft(1)
    for _ in range(3):
        adaptive.record_step(1, 4, 0.06, tokens=tokens_per_step)
    for _ in range(20):                                    # the answer leaves the copied text
        propose(adaptive, "r")
        adaptive.observe("r", [7])
    assert adaptive.choose(["r"], [4]) == 1
    return adaptive


class Heard(PolicyListener):
    """Hears the switch and the episode's end only (the other events stay no-ops)."""

    def __init__(self):
        self.events: list[tuple] = []

    def switch_requested(self, bucket, expected_gain):
        self.events.append(("switch", bucket, expected_gain))

    def episode_ended(self, bucket, episode, plain_rate, reopened):
        self.events.append(("ended", bucket, episode.steps, episode.tokens, plain_rate, reopened))


@pytest.mark.parametrize("tokens_per_step, won", [(3, True), (1, False)])
def test_a_listener_hears_the_probes_switch_and_the_episode_it_started_end(tokens_per_step, won):
    heard = Heard()
    adaptive = drafting_bucket(tokens_per_step, heard)
    [switch, ended] = heard.events
    assert switch[:2] == ("switch", 1) and switch[2] == pytest.approx((4 / 0.06) / (1 / 0.05), rel=0.05)
    assert ended == ("ended", 1, 3, 3 * tokens_per_step, pytest.approx(20.0), won)
    adaptive.listen(None)
    adaptive.record_step(1, 1, 0.05, tokens=1)
    assert len(heard.events) == 2 and adaptive.listener is None and adaptive.modes.listener is None


def plain_steps_that_probe(adaptive: AdaptiveDraftLength, steps: int) -> list[int]:
    probed = []
    for step in range(1, steps + 1):
        if adaptive.probe_due(1):
            probed.append(step)
        adaptive.record_step(1, 1, 0.05, tokens=1)
    return probed


def test_an_episode_that_won_leaves_the_bucket_open_and_probes_the_steps_after_it():
    adaptive = drafting_bucket(tokens_per_step=3)          # 50 tokens/s against plain's 20: won
    adaptive.record_probe(1, 32 * 0.01 * 0.05)             # probes dear enough for k = 32
    assert adaptive.probe_every(1) == 32
    assert plain_steps_that_probe(adaptive, 32) == list(REOPEN_FOLLOW_UPS)
    adaptive = drafting_bucket(tokens_per_step=3)
    assert plain_steps_that_probe(adaptive, 2) == [1, 2]
    for _ in range(20):                                    # the copy resumes two tokens on
        propose(adaptive, "r")
        adaptive.observe("r", [1, 2, 3, 8])
    adaptive.probe(1, ["r"], [4])                          # no hold, none held against the request
    assert adaptive.would_draft(1)


def test_an_episode_that_lost_or_barely_won_holds_the_bucket():
    for tokens_per_step in (1, 2):                         # 17 and 33 tokens/s: 0.83x and 1.67x ... of 20
        adaptive = drafting_bucket(tokens_per_step)
        if tokens_per_step == 1:
            assert adaptive.modes.plain_until[1] > adaptive.costs.steps(1)   # held, against the request
            assert adaptive.modes._held_for[1] == {"r"}
        else:
            assert adaptive.modes.plain_until[1] == adaptive.costs.steps(1)  # won by the margin: open
    barely = BucketModes()                                 # a win below the margin holds
    barely.should_draft(1, 0)
    barely.record_outcome(1, 1, 0.05, 1)                   # plain: 20 tokens/s
    barely.request_switch(1)
    barely.should_draft(1, 1), barely.should_draft(1, 1)
    barely.record_outcome(1, 11, 0.5, 2)                   # 22 tokens/s: 1.1x, under SWITCH_MARGIN
    assert not barely.go_plain(1, 3, reopen_margin=SWITCH_MARGIN)
    assert barely.plain_until[1] == 3 + PLAIN_HOLD


def test_a_large_bucket_is_reopened_without_follow_up_probes():
    schedule = ProbeSchedule()
    schedule.record(64, 1.0, 0.001)                        # k at its cap
    schedule.reopen(64)
    assert [schedule.due(64) for _ in range(16)] == [False] * 16


def test_follow_ups_stop_once_a_probe_switches():
    schedule = ProbeSchedule()
    schedule.record(1, 1.0, 0.001)
    schedule.reopen(1)
    assert schedule.due(1)                                 # the first plain step after the episode
    schedule.verdict(1, switched=True)
    assert [schedule.due(1) for _ in range(16)] == [False] * 16


def episode(modes: BucketModes, expected_gain: float | None, realized_gain: float, steps: int,
            batch_size: int = 1) -> int:
    """A switch expecting `expected_gain`, a one-step episode of `batch_size` requests
    realizing `realized_gain` x plain's 20 tokens/s a request, and its end; returns the step
    count after it."""
    modes.request_switch(1, expected_gain)
    modes.should_draft(1, steps), modes.should_draft(1, steps)
    modes.record_outcome(1, 20 * realized_gain * batch_size, 1.0, steps + 1, batch_size=batch_size)
    modes.go_plain(1, steps + 1)
    return steps + 1


def test_episode_overshoot_is_the_median_expected_over_realized_of_the_last_episodes():
    """Episodes of 96 request-steps: each record is its expected / realized gain, shrunk
    towards 1 by a quarter (OVERSHOOT_EVIDENCE of 32)."""
    modes = BucketModes()
    modes.should_draft(1, 0)
    modes.record_outcome(1, 1, 0.05, 1)                    # plain: 20 tokens/s
    weight = 96 / (96 + OVERSHOOT_EVIDENCE)
    steps = 1
    for expected in (3.0, 3.0, 1.5):
        steps = episode(modes, expected, 1.5, steps, batch_size=96)
    assert modes.episode_overshoot[1] == pytest.approx(1 + (2.0 - 1) * weight)
    steps = episode(modes, None, 0.5, steps, batch_size=96)   # a switch to price a tier: no expectation
    assert modes.episode_overshoot[1] == pytest.approx(1 + (2.0 - 1) * weight)
    for _ in range(EPISODE_WINDOW):
        steps = episode(modes, 1.2, 1.2, steps, batch_size=96)
    assert modes.episode_overshoot[1] == pytest.approx(1.0)


@pytest.mark.parametrize("batch_size, steps, overshoot", [(1, 9, 1.053), (32, 8, 1.215)])
def test_an_episode_of_little_evidence_raises_the_switch_margin_little(batch_size, steps, overshoot):
    """An H100 trace (1.5B, the kept head, chat sampled at batch 1): a probe expected 1.23x, the
    episode's 9 steps realized 0.99x of plain, and its record, 1.24 taken as it was, raised the
    switch margin to 1.30, above what the timed run's first probe expected: the bucket decoded
    plainly where pinned drafting made 1.43x. One request's 9 steps now count for 9/41 of it;
    32 requests' 8 steps (256 request-steps) for nearly all."""
    modes = BucketModes()
    modes.should_draft(1, 0)
    modes.record_outcome(1, batch_size, 0.05, 1, batch_size=batch_size)   # plain: 20 tokens/s a request
    modes.request_switch(1, 1.23)
    modes.should_draft(1, 1), modes.should_draft(1, 1)
    for step in range(steps):
        modes.record_outcome(1, 0.99 * 20 * 0.05 * batch_size, 0.05, 2 + step, batch_size=batch_size)
    modes.go_plain(1, 2 + steps)
    assert modes.episode_overshoot[1] == pytest.approx(overshoot, abs=1e-3)


@pytest.mark.parametrize("overshoot, margin", [(None, 1.0), (0.8, 1.0), (1.5, 1.5), (5.0, MAX_OPTIMISM)])
def test_the_switch_margin_grows_with_the_episodes_overshoot(overshoot, margin):
    adaptive = AdaptiveDraftLength([1, 4])
    if overshoot is not None:
        adaptive.modes.episode_overshoot[1] = overshoot
    assert adaptive.switch_margin_at(1) == pytest.approx(SWITCH_MARGIN * margin)
    adaptive.optimism[1] = 1.3                             # the larger of the two records counts
    assert adaptive.switch_margin_at(1) == pytest.approx(SWITCH_MARGIN * max(margin, 1.3))
    adaptive.optimism[1] = 2.5                             # and no more than MAX_OPTIMISM
    assert adaptive.switch_margin_at(1) == pytest.approx(SWITCH_MARGIN * MAX_OPTIMISM)


def test_a_probes_trace_names_the_margin_it_had_to_beat_and_what_raised_it():
    adaptive = AdaptiveDraftLength([1, 4])
    adaptive.modes.episode_overshoot[16] = 1.2
    trace = PolicyTrace(adaptive)
    trace.rated(16, 16, ["a"], [4], None, False, PLAIN, {1: 100.0, 4: 113.0})
    trace.rated(16, 16, ["a"], [4], None, True, PLAIN, {1: 100.0, 4: 113.0})   # a drafting step's choice: no margin
    trace.close()
    probe, choice = trace.events
    assert probe["margin"] == pytest.approx(SWITCH_MARGIN * 1.2, abs=1e-3)
    assert (probe["overshoot"], probe["optimism"]) == (1.2, None) and "margin" not in choice


def test_a_probe_that_switches_records_the_gain_it_expected():
    adaptive = drafting_bucket(tokens_per_step=3)
    for _ in range(20):
        propose(adaptive, "r")
        adaptive.observe("r", [1, 2, 3, 8])                # every node accepted: 4 tokens a 0.06-s step
    adaptive.probe(1, ["r"], [4])
    assert adaptive.modes._switch_gain[1] == pytest.approx((4 / 0.06) / (1 / 0.05), rel=0.05)


def admission_gaps(schedule: ProbeSchedule, switched: bool, count: int) -> list[int]:
    """Plain steps of bucket 64 from an admission to its probe, `count` times in a row, each
    probe's verdict `switched`."""
    gaps = []
    for _ in range(count):
        schedule.admit()
        waited = 1
        while not schedule.due(64):
            waited += 1
        gaps.append(waited)
        schedule.verdict(64, switched)
    return gaps


def test_a_large_batchs_admission_probes_back_off_while_they_keep_it_plain():
    schedule = ProbeSchedule()
    schedule.record(64, 1.0, 0.001)                        # k at its cap: only admissions pull probes forward
    kept = admission_gaps(schedule, switched=False, count=4)
    assert kept == [ADMIT_GAP << min(i, ADMIT_BACKOFF_DOUBLINGS) for i in range(4)]
    admission_gaps(schedule, switched=True, count=1)       # a switch resets the gap
    assert admission_gaps(schedule, switched=False, count=1) == [ADMIT_GAP]
    small = ProbeSchedule()                                # a batch a probe covers whole: every admission
    small.record(8, 1.0, 0.001)
    for _ in range(3):
        small.admit()
        assert small.due(8)
        small.verdict(8, switched=False)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("name, at_least", [("batch 1: copies with edits", 2.1), ("copies with edits, concurrency 8", 2.0)])
def test_simulated_copies_with_edits_draft_again_after_each_edit(name, at_least, ragged):
    """policy_sim: answers that copy the prompt with an edit every 40 tokens. Each episode
    ends at an edit; held PLAIN_HOLD steps and probed at k, the bucket ran ~1.6x plain."""
    profiles, concurrency = SCENARIOS[name]
    result, vs_plain, _ = simulate(profiles(0), concurrency, ragged=ragged)
    assert result.drafting_fraction > 0.45 and vs_plain > at_least, (result, vs_plain)


def won_by_a_run_of_misses() -> AdaptiveDraftLength:
    """Batch 1, plain steps of 0.05 s (20 tokens/s), tier 4 priced 0.06 s; a probe switches and
    the episode's choices draft "r": 6 steps commit all 4 tokens, then drafts miss until its
    estimate falls below plain's and the choice ends the episode (~1.9x plain: won)."""
    adaptive = AdaptiveDraftLength([1, 4])
    adaptive.record_step(1, 4, 0.06)
    assert not adaptive.should_draft(1)
    for _ in range(PLAIN_HOLD):
        adaptive.record_step(1, 1, 0.05, tokens=1)
    adaptive.probe(1, ["r"], [4])
    assert not adaptive.should_draft(1) and adaptive.should_draft(1)
    for committed in [[1, 2, 3, 8]] * 6 + [[7]] * 20:
        propose(adaptive, "r")
        if adaptive.choose(["r"], [4]) == 1:
            return adaptive
        adaptive.observe("r", committed)
        adaptive.record_step(1, 4, 0.06, tokens=len(committed))
    raise AssertionError("the choice never ended the episode")


def test_an_episode_that_won_leaves_no_overshoot_to_raise_the_next_switchs_margin():
    """The steps an episode ends on disappointed its choice (that is why it ended), so its last
    window reads as overshoot whatever the model's mean: kept, the margin rose to SWITCH_MARGIN
    x MAX_OPTIMISM and a probe expecting 1.67x (a kept EAGLE-3 head at batch 1) stayed plain."""
    adaptive = won_by_a_run_of_misses()
    assert adaptive.modes.plain_until[1] == adaptive.costs.steps(1)   # won: the bucket is open
    assert adaptive.switch_margin_at(1) == pytest.approx(SWITCH_MARGIN)
    for _ in range(20):                                    # a new request: one draft of three accepted
        propose(adaptive, "s")
        adaptive.observe("s", [1, 8])
    gain = adaptive.expected_tokens("s", 4) / 0.06 / 20
    assert SWITCH_MARGIN < gain < SWITCH_MARGIN * MAX_OPTIMISM
    adaptive.probe(1, ["s"], [4])
    assert adaptive.would_draft(1)


def test_an_episode_that_lost_keeps_its_overshoot():
    modes = BucketModes()
    modes.should_draft(1, 0)
    modes.record_outcome(1, 1, 0.05, 1)                    # plain: 20 tokens/s
    modes.request_switch(1, 3.0)
    modes.should_draft(1, 1), modes.should_draft(1, 1)
    modes.record_outcome(1, 15, 1.0, 2)                    # 15 tokens/s: lost
    assert not modes.go_plain(1, 3, reopen_margin=SWITCH_MARGIN)
    record = 1 + (3.0 / 0.75 - 1) / (1 + OVERSHOOT_EVIDENCE)   # one request-step of evidence
    assert modes.episode_overshoot[1] == pytest.approx(record)
    modes.request_switch(1, 3.0)
    modes.should_draft(1, 3), modes.should_draft(1, 3)
    modes.record_outcome(1, 30, 1.0, 4)                    # 30 tokens/s: won by the margin, no record
    assert modes.go_plain(1, 5, reopen_margin=SWITCH_MARGIN)
    assert modes.episode_overshoot[1] == pytest.approx(record)


def test_a_batch1_eagle_bucket_whose_drafts_pay_drafts_most_of_its_timed_steps():
    """lab/policy_sim_b1: a warm-up, then the timed answers on the same policy, an H200 trace's
    costs and drafts accepted as on code-types (~2.95 tokens a step at 1.76x plain's cost): it
    drafts 0.98 of the timed steps (8 seeds), the slowest cell 1.54x plain (pinned: 1.68x)."""
    cells = [timed_cell(0.8, seed) for seed in range(8)]
    assert sum(fraction for fraction, _ in cells) / len(cells) > 0.7
    assert min(speed for _, speed in cells) > 1.15


@pytest.mark.parametrize("draft_steps, step_s, doubles", [(2, 0.06, False), (6, 0.10, True)])
def test_a_lost_episode_doubles_the_hold_only_where_its_loss_outweighs_the_short_hold(draft_steps, step_s, doubles):
    """Batch 1, plain at 20 tokens/s, drafting steps that commit one token each. Two of 0.06 s
    (a short episode whose drafts missed) lose 0.02 s, paid back within BYPASS_BUDGET by 4
    plain steps, fewer than PLAIN_HOLD: the hold stays as it was, still against the request
    that lost and with a bypass budget. Six of 0.1 s lose 0.3 s (60 plain steps): it doubles."""
    modes = BucketModes()
    assert not modes.should_draft(1, 0)
    modes.hold[1] = 2 * PLAIN_HOLD   # an earlier loss had doubled it
    for step in range(4):
        modes.record_outcome(1, tokens=1, seconds=0.05, steps=step)
    modes.drafted[1] = ["r"]
    modes.request_switch(1, expected_gain=1.5)
    assert modes.would_draft(1, 4) and modes.should_draft(1, 4)
    for step in range(4, 4 + draft_steps):
        modes.record_outcome(1, tokens=1, seconds=step_s, steps=step)
    modes.go_plain(1, 4 + draft_steps)
    payback_steps = draft_steps * (step_s - 0.05) / BYPASS_BUDGET * 20
    assert (payback_steps > PLAIN_HOLD) is doubles
    assert modes.hold[1] == (min(4 * PLAIN_HOLD, MAX_PLAIN_HOLD) if doubles else 2 * PLAIN_HOLD)
    assert modes.bypass_after[1] > 0
    assert not modes.may_switch(1, 4 + draft_steps + 1, ["r"])   # held against the request either way


def leave_choice(leave_margin: float, tier_seconds: float, batch_size: int) -> int:
    """The tier a drafting step of `batch_size` requests chooses: plain steps at 20 tokens/s a
    request, tier 4 priced at `tier_seconds`, drafts that commit one token a step."""
    adaptive = AdaptiveDraftLength([1, 4], leave_margin=leave_margin)
    adaptive.record_step(batch_size, 1, 0.05)
    adaptive.record_step(batch_size, 4, tier_seconds)
    rids = [f"r{i}" for i in range(batch_size)]
    for _ in range(30):
        for rid in rids:
            propose(adaptive, rid)
            adaptive.observe(rid, [7])
    assert adaptive.expected_tokens("r0", 4) == pytest.approx(1.0, abs=1e-3)
    return adaptive.choose(rids, [4] * batch_size)


def test_a_drafter_dear_to_restart_drafts_on_while_plain_is_expected_to_win_by_little():
    """The drafter's leave margin: an episode ends where its best tier is expected below that
    fraction of plain's rate, not where plain is first expected to win. Batch 4: tier 4 priced
    at 0.055 s (0.91x plain) ends the episode at the default margin and goes on at 0.85; at
    0.0625 s (0.8x) it ends at both."""
    assert leave_choice(1.0, 0.055, 4) == 1
    assert leave_choice(0.85, 0.055, 4) == 4
    assert leave_choice(0.85, 0.0625, 4) == leave_choice(1.0, 0.0625, 4) == 1


@pytest.mark.parametrize("batch_size, margin", [(1, 0.70), (2, 0.788), (3, 0.827), (4, 0.85), (64, 0.85)])
def test_a_small_batch_leaves_further_below_plain(batch_size, margin):
    """Fewer requests, noisier expected rates: below LEAVE_MARGIN_BATCH the margin widens with
    the square root of the batch (0.70 at batch 1 for a drafter's 0.85). At batch 1 a step
    expected at 0.8x plain drafts on and one at 0.67x ends; a drafter without a margin ends
    where plain is expected to win whatever the batch."""
    adaptive = AdaptiveDraftLength([1, 4], leave_margin=0.85)
    assert adaptive.leave_margin_at(batch_size) == pytest.approx(margin, abs=1e-3)
    assert AdaptiveDraftLength([1, 4]).leave_margin_at(batch_size) == 1.0
    if batch_size == 1:
        assert leave_choice(0.85, 0.0625, 1) == 4
        assert leave_choice(0.85, 0.075, 1) == 1
        assert leave_choice(1.0, 0.0625, 1) == 1


@pytest.mark.parametrize("costs, fraction, speed", [(GREEDY, 0.2, 1.04), (SAMPLED, 0.4, 1.12)])
def test_a_batch1_eagle_chain_at_chat_accept_drafts_more_with_its_leave_margin(costs, fraction, speed):
    """lab/policy_sim_b1 with drafts accepted as on chat (p 0.62: ~2.24 tokens a step, pinned
    1.27x plain at the greedy steps' costs, 1.38x at the sampled ones'), 24 seeds: the fused
    chain's leave margin (0.70 at batch 1) drafts 0.27 / 0.50 of the timed steps, 1.065x /
    1.18x plain, where ending at plain's rate drafted 0.01 / 0.06 (1.00x / 1.02x)."""
    cells = [timed_cell(0.62, seed, costs) for seed in range(24)]
    assert sum(f for f, _ in cells) / len(cells) > fraction
    assert sum(v for _, v in cells) / len(cells) > speed


@pytest.mark.parametrize("prefill", [False, True])
def test_steps_that_carried_the_drafters_prefill_do_not_stop_an_episode(prefill):
    """Batch 64, plain at 2.45 ms a step (a token a request), an episode of chained steps that
    commit 2.3 tokens a request in 4.6 ms (1.22x over plain) with one 12.8-ms stall, as an
    H100 trace had them (1.5B, EAGLE-3, ShareGPT second turns). Then a wave of new requests:
    two steps of 20 and 16 ms carried the head's prefill of their prompts. Judged with the
    others they pull the guard's window below plain and stop the episode; flagged as the
    drafter's prefill they are left out, and the episode goes on."""
    modes = BucketModes()
    assert not modes.should_draft(64, 0)
    for step in range(PLAIN_HOLD):
        modes.record_outcome(64, tokens=64, seconds=0.00245, steps=step, batch_size=64)
    modes.request_switch(64, expected_gain=1.3)
    assert modes.would_draft(64, PLAIN_HOLD) and modes.should_draft(64, PLAIN_HOLD)
    steps = iter(range(PLAIN_HOLD, PLAIN_HOLD + 20))
    for _ in range(13):
        modes.record_outcome(64, tokens=147, seconds=0.0046, steps=next(steps), batch_size=64)
    modes.record_outcome(64, tokens=149, seconds=0.0128, steps=next(steps), batch_size=64)
    for tokens, seconds in [(104, 0.0203), (112, 0.0157)]:
        modes.record_outcome(64, tokens=tokens, seconds=seconds, steps=next(steps), batch_size=64, prefill=prefill)
    assert (64 not in modes.plain) is prefill
    assert modes.episode_steps(64) == (14 if prefill else 0)


@pytest.mark.parametrize("drafting", [True, False])
def test_a_batch_that_shrinks_out_of_a_drafting_bucket_probes_at_once_with_costly_probes(drafting):
    """A model drafter's probes (every_at_least 16) come 16 plain steps apart, about what a bucket
    lasts while a wave drains. A batch that drafted at 32 and shrinks to 16, a plain bucket,
    probes its first plain step there; one that decoded plainly at 32 waits as before."""
    policy = AdaptiveDraftLength([1, 4])
    assert not policy.should_draft(32)                     # a new bucket starts plain
    if drafting:
        policy.modes.request_switch(32, expected_gain=1.3)
        assert not policy.should_draft(32) and policy.should_draft(32)
    assert not policy.should_draft(16)
    assert policy.probe_due(16, every_at_least=16, every_at_most=128) is drafting
    assert not policy.probe_due(16, every_at_least=16, every_at_most=128)   # once


def test_an_episode_the_guard_stops_is_judged_won_where_it_beat_plain():
    """The guard stops an episode once its recent steps fall below plain's rate; an episode
    that beat plain by the margin all the same reopens its bucket and leaves no overshoot
    record (policy.record_step then clears its choices' optimism too), one that did not keeps it."""
    for early_tokens, wins in ((60, True), (20, False)):
        modes = BucketModes()
        modes.should_draft(1, 0)
        modes.record_outcome(1, 1, 0.05, 1)                # plain: 20 tokens/s
        modes.request_switch(1, 3.0)
        modes.should_draft(1, 1), modes.should_draft(1, 1)
        assert not modes.record_outcome(1, early_tokens, 1.0, 2, reopen_margin=SWITCH_MARGIN)
        for step in range(3, 3 + 3 * GUARD_STEPS):   # 10 tokens/s from here
            verdict = modes.record_outcome(1, 0.5, 0.05, step, reopen_margin=SWITCH_MARGIN)
            if 1 in modes.plain:
                break
        assert 1 in modes.plain, "the guard did not stop the episode"
        assert verdict is wins
        assert (1 in modes.episode_overshoot) is not wins
