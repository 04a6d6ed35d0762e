"""BucketModes: whether each batch-size bucket drafts or decodes plainly, how long it is
held plain, and the guard that stops drafting which realizes less than plain decoding.

Two modes per batch bucket, which starts plain. Drafting: every step proposes and picks its
tier; a step that picks 1 switches the bucket to plain. Plain: steps run on the overlapped
plain path (the next step queued before this one's tokens are read), probes keep the
evidence coming (probes.py), and the bucket switches back to drafting as soon as a
tier above 1 is expected to win.

The policy's model can be wrong (a class's history may not transfer to new text, a probe
sees a sample), so measured outcomes have the last word: the engine reports the tokens
every step committed, a bucket keeps the realized rate (tokens per second) of its plain
steps (the median of the last REALIZED_WINDOW), and each drafting episode (from a switch to
drafting until the next switch back) is compared with it; a bucket with no plain rate yet
does not switch. An episode that falls below GUARD_RATIO of the plain rate after
GUARD_STEPS steps is stopped; an episode that lost doubles how long the bucket then stays
plain before probes may switch it again (PLAIN_HOLD .. MAX_PLAIN_HOLD steps); one that won
resets it. A probe's switch waits for the step already launched ahead to finish instead
of throwing it away.

Only a loss that PLAIN_HOLD plain steps do not pay back within BYPASS_BUDGET doubles the
hold; a smaller one leaves it as it was (a hold of PLAIN_HOLD steps already pays it back).
At batch 1 an episode of two or three steps whose drafts missed loses 1.4-1.7 ms, what 11-14
plain steps pay back at BYPASS_BUDGET: an H200 policy trace (1.5B, agentic tool calls under
their grammars, default NGRAM 1.47x plain where a fixed 16-node chain made 2.1x) held its
request 32 steps after such an episode, 62 in all before a probe switched again, and the
run's last 27 after the next. Episodes at 64 lose 10-25 ms (50-120 plain steps) and double
as before.

An episode that won by the switch margin is no verdict against drafting at all: it ended
where one step's drafts were not worth verifying (an answer that leaves the copied text at
an edit, a repeated turn that leaves the earlier answer's path at a near-tie), and the
drafts that pay are often back a few tokens later. Such an episode leaves its bucket open
(`go_plain` returns True): no hold, no request held against, and the policy has a small
batch probe its next plain steps (probes.py: reopen). Held PLAIN_HOLD steps and
probed every ~10th, a batch-1 repeated turn on an H200 (0.5B, session 34) spent 247-272 of
its 300-350 steps plain after episodes that had made 3.4-8.8k tok/s against plain's 1.7k.

A probe's switch is also judged by what its episodes realized: the gain over plain
decoding a switch expected, over the gain its episode realized, median of the bucket's last
EPISODE_WINDOW episodes, is `episode_overshoot` (the policy raises its switch margin by it).
A drafting step's own choice may expect what it then realizes while the episode still
disappoints the probe that started it: on an H200 (1.5B, multi-turn chat at 32, session 34)
probes expected 1.56-1.57x, the episodes realized 1.03-1.06x, each switch a step not launched
ahead and requests pulled apart.
An episode's record counts as far as it saw (OVERSHOOT_EVIDENCE): a batch-1 episode of a
few steps realizes mostly its draws' luck, and one such record (H100, 1.5B, chat sampled at
batch 1: 9 steps, expected 1.23x, realized 0.99x) raised the margin to 1.30 for the rest of a
run where pinned drafting made 1.43x; 32 requests' 8 steps count for nearly all of theirs.
An episode that won by the switch margin adds no record: its switch paid, and the run of
disappointing steps its choice ended it on is no measure of the probe (H200, 1.5B, EAGLE-3 at
batch 1, code-types: the records a warm-up left raised the margin above the 1.28x the timed
run's first probe expected, and the bucket stayed plain where drafting made 1.53x).

A hold is a verdict on the requests that lost, not on the bucket forever: the episode's
requests are kept with it, and a probe whose sample holds none of them (a new
conversation at batch 1, a batch that has turned over) may switch before the hold ends.
Without the bypass, one chat that drafted badly kept a batch-1 server plain for up to
MAX_PLAIN_HOLD steps, through the next requests whose drafts matched in full (an H100
"repeated turn" at batch 1: 196 plain steps beside 35 drafting ones, 1.42x).
Only none: with "mostly new" (H100, 1.5B, ShareGPT first turns at concurrency 64, where the
batch turns over every few steps) every few new requests started another losing episode
(0.63x, 118 drafting steps at accept 1.75); and with "none" still 144 at accept 1.6 (0.65x):
at 64 prefills complete every few steps, each makes the next plain step probe (`admit`),
and its sample of new requests, expected to match, switched the batch of 64 again.
So bypasses are paid for: after an episode that lost, none comes before the bucket has
decoded for BYPASS_BUDGET^-1 times what the episode lost (its time minus what plain steps
would have taken for its tokens), so episodes that lose, whatever the model expected, cost
at most about BYPASS_BUDGET of a bucket's time. At batch 1 a losing episode (8 verify steps)
loses ~15 ms on an H100 1.5B: the next request may bypass ~100 plain steps later, about when
a 128-token chat ends; at 64 (~25 ms) about 100 steps pass between bypasses, not 3.

Rates are per request (tokens a request commits per second): a bucket spans batch sizes
from half its size up, and its plain steps were often timed while the batch filled (H100,
0.5B, ShareGPT second turns at 32: plain steps at ~20 requests set the reference, a drafting
episode at 32 requests realized more tokens per second than that while each request got 2.2
tokens per 5.0 ms step against 1 per 1.55 ms plain, and it was never stopped: 0.83x). The
reference is every plain-mode step, steady or not: where the batch turns over, half of plain
mode's steps follow a prefill and take ~2x a steady one, and a reference of steady steps
alone stopped episodes that won (H100, 0.5B, code-rename at 64: 0.94x where it had drafted
at 1.13x). The guard judges an episode by its last GUARD_WINDOW steps but the slowest, so
that an episode that won at first (or during a warm-up) is stopped when it starts to lose,
and one stall (a 30 ms step among 5 ms ones) does not stop an episode that wins.

A bucket may draft without ever having decoded plainly as plain mode does (its hold passed
while prefills broke every plain step's launch ahead): both the price of plain decoding and
the reference are then makeshift, from steps that cost ~2x a steady one, and drafting looks
better than it is (the episode above, drafting all of a timed run). Such a bucket is sent
plain for a trial (`plain_trial`, not a verdict on the episode) after GUARD_STEPS drafting
steps, and probes do not switch it back before plain decoding is steadily priced there.

Holds count in the bucket's recorded steps (StepCosts.steps), which callers pass in.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.speculative.adaptive.costs import RecentMedians

# realized plain-mode rate: the median over this many plain steps is the episodes' reference
# (a median: plain steps that probe wait for the indexing of new prompts, tens of ms at 64)
REALIZED_WINDOW = 16
GUARD_STEPS = 8        # a drafting episode is judged on its realized rate after this many steps
GUARD_WINDOW = 16      # ... over its last this many steps
GUARD_RATIO = 0.97     # ... and stopped below this fraction of the plain rate
PLAIN_HOLD = 16        # steps a bucket stays plain after a drafting episode that won (or its first)
MAX_PLAIN_HOLD = 1024  # after episodes that lost the hold doubles, up to this
BYPASS_BUDGET = 0.1    # the time losing episodes lose may be this fraction of the time before a bypass
EPISODE_WINDOW = 5     # episodes whose expected / realized gain make a bucket's episode_overshoot
# an episode's overshoot record counts for requests x steps / (requests x steps + this): one of few
# requests and steps, whose realized rate is mostly noise, moves the switch margin little
OVERSHOOT_EVIDENCE = 32


@dataclass
class Episode:
    """A bucket's drafting run since it last switched to drafting: tokens per request of
    the batch, and seconds, in all and over its last GUARD_WINDOW steps."""
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    request_steps: int = 0               # its steps' batch sizes, summed
    recent: deque = field(default_factory=lambda: deque(maxlen=GUARD_WINDOW))
    expected_gain: float | None = None   # over plain decoding, what the probe that switched expected
    pricing: bool = False                # switched to price tiers (no gain expected): a loss is no verdict

    def add(self, tokens: float, seconds: float, batch_size: int = 1) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1
        self.request_steps += batch_size
        self.recent.append((tokens, seconds))

    def overshoot(self, plain_rate: float) -> float:
        """The gain the probe expected over the gain realized, shrunk towards 1 by how little
        the episode saw (OVERSHOOT_EVIDENCE)."""
        measured = self.expected_gain / (self.rate() / plain_rate)
        return 1.0 + (measured - 1.0) * self.request_steps / (self.request_steps + OVERSHOOT_EVIDENCE)

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def recent_rate(self) -> float:
        """Over the recent steps but the slowest."""
        slowest = max(range(len(self.recent)), key=lambda i: self.recent[i][1])
        kept = [step for i, step in enumerate(self.recent) if i != slowest]
        seconds = sum(s for _, s in kept)
        return sum(t for t, _ in kept) / seconds if seconds > 0 else 0.0


class BucketModes:
    def __init__(self) -> None:
        self.plain: set[int] = set()                       # buckets in plain mode
        self.switching: dict[int, bool] = {}               # bucket -> a probe's switch waits (True: next step)
        self._switch_gain: dict[int, float | None] = {}    # bucket -> the gain its waiting switch expected
        self.episode_overshoot: dict[int, float] = {}      # bucket -> median expected / realized gain of its episodes
        self._overshoots = RecentMedians(EPISODE_WINDOW)
        self.hold: dict[int, int] = {}                     # bucket -> steps to stay plain after an episode
        self.plain_until: dict[int, int] = {}              # bucket -> step count before which probes wait
        self.plain_rate: dict[int, float] = {}             # bucket -> realized tokens/s a request, plain steps
        self._plain_rates = RecentMedians(REALIZED_WINDOW)  # bucket -> its last plain steps' rates
        self._episodes: dict[int, Episode] = {}           # bucket -> its current drafting episode
        self.drafted: dict[int, list[str]] = {}            # bucket -> the requests of its last drafting step
        self._held_for: dict[int, frozenset[str]] = {}     # bucket -> the requests its hold is about
        self.clock: dict[int, float] = {}                  # bucket -> seconds of its steps so far
        self.bypass_after: dict[int, float] = {}           # bucket -> clock before which no probe bypasses
        self.listener = None                               # a PolicyListener: hears episodes end (listener.py)

    def should_draft(self, bucket: int, steps: int) -> bool:
        """Whether this step drafts: False while the bucket is in plain mode. A switch a
        probe asked for takes effect the step after next (see would_draft)."""
        self._enter(bucket, steps)
        if bucket in self.switching:
            if not self.switching[bucket]:
                self.switching[bucket] = True   # this step still decodes plainly (e.g. one launched ahead)
                return False
            del self.switching[bucket]
            self.plain.discard(bucket)
            gain = self._switch_gain.pop(bucket, None)
            self._episodes[bucket] = Episode(expected_gain=gain, pricing=gain is None)
        return bucket not in self.plain

    def would_draft(self, bucket: int, steps: int) -> bool:
        """Whether the step after this one may draft: no plain step is launched ahead then
        (a step launched ahead and not used is a GPU step thrown away)."""
        self._enter(bucket, steps)
        if bucket in self.switching:
            self.switching[bucket] = True
            return True
        return bucket not in self.plain

    def _enter(self, bucket: int, steps: int) -> None:
        """A bucket seen for the first time starts plain, held for PLAIN_HOLD steps: its
        plain rate is the reference drafting must beat (at large batches a verify step
        costs several plain ones, and optimistic priors would otherwise draft first and
        learn later). This first hold is about no request, so once its first plain step has
        set the reference a probe may bypass it (holding every new bucket for all PLAIN_HOLD
        steps cut the simulated repeated turn at 32/64 from >= 85% drafting steps to 61%)."""
        if bucket not in self.hold:
            self.hold[bucket] = PLAIN_HOLD
            self.plain_until[bucket] = steps + PLAIN_HOLD
            self.plain.add(bucket)

    def may_switch(self, bucket: int, steps: int, rids: list[str]) -> bool:
        """Whether a probe of these requests may ask this bucket to draft: it is plain, no
        switch waits, and its hold has passed or none of the probed requests is one it
        holds against (while held, the probes' shadows still gather evidence)."""
        if bucket not in self.plain or bucket in self.switching:
            return False
        if bucket not in self.plain_rate:
            # no realized plain rate yet: an episode would have nothing to be judged against,
            # and its guard could never stop it (a CPU replay with H100-like step costs:
            # bucket 64, switched by a bypass of its first hold before any plain step was
            # recorded, drafted all of its 131 steps at a loss)
            return False
        if steps >= self.plain_until.get(bucket, 0):
            return True
        if self.clock.get(bucket, 0.0) < self.bypass_after.get(bucket, 0.0):
            return False
        held = self._held_for.get(bucket, frozenset())
        return not any(rid in held for rid in rids)

    def request_switch(self, bucket: int, expected_gain: float | None = None) -> None:
        """The bucket drafts again once the step launched ahead of it has run; `expected_gain`:
        the rate over plain decoding's the probe expected (None: a switch to price a tier)."""
        self.switching[bucket] = False
        self._switch_gain[bucket] = expected_gain

    def go_plain(self, bucket: int, steps: int, reopen_margin: float | None = None) -> bool:
        """Ends the bucket's drafting episode; how long it now stays plain depends on
        whether the episode beat plain decoding's realized rate. One that beat it by
        `reopen_margin` (None: never) holds nothing: the bucket stays open to the next
        probe, and the return is True."""
        ended = self._episodes.pop(bucket, None)
        episode = Episode() if ended is None else ended
        plain_rate = self.plain_rate.get(bucket)
        hold = self.hold.get(bucket, PLAIN_HOLD)
        judged = plain_rate is not None and episode.steps > 0
        # an episode that priced tiers (a probe's switch that expected no gain) and lost learned
        # their prices: no verdict, as a plain trial. Counted as one, the first episode of a
        # busy CPU's batch-1 bucket (16 nodes at 4x a plain step, tried at the floor price)
        # held it plain ~40 steps, a third of a 175-token answer whose 4-node drafts paid
        lost = judged and episode.rate() < plain_rate and not episode.pricing
        won = judged and reopen_margin is not None and episode.rate() >= reopen_margin * plain_rate
        if lost:   # what it lost: its time minus what plain steps would have taken for its tokens
            loss = episode.seconds - episode.tokens / plain_rate
            self.bypass_after[bucket] = self.clock.get(bucket, 0.0) + loss / BYPASS_BUDGET
            if loss / BYPASS_BUDGET * plain_rate > PLAIN_HOLD:   # plain steps (a token a request) to pay it back
                hold = min(2 * hold, MAX_PLAIN_HOLD)
        else:
            hold = PLAIN_HOLD
        if judged and not won and episode.expected_gain is not None and episode.tokens > 0:
            self.episode_overshoot[bucket] = self._overshoots.add(bucket, episode.overshoot(plain_rate))
        self.hold[bucket] = hold
        self.plain_until[bucket] = steps if won else steps + self.hold[bucket]
        self._held_for[bucket] = frozenset() if won else frozenset(self.drafted.get(bucket, ()))
        self.plain.add(bucket)
        if self.listener is not None and ended is not None:
            self.listener.episode_ended(bucket, ended, plain_rate, won)
        return won

    def plain_trial(self, bucket: int, steps: int) -> None:
        """Plain decoding for PLAIN_HOLD steps to price it as plain mode runs it: ends the
        episode without a verdict (no hold doubles, no request is held against)."""
        self._episodes.pop(bucket, None)
        self.plain_until[bucket] = steps + PLAIN_HOLD
        self._held_for[bucket] = frozenset()
        self.plain.add(bucket)

    def episode_steps(self, bucket: int) -> int:
        """Steps of the bucket's current drafting episode (0 in plain mode)."""
        episode = self._episodes.get(bucket)
        return 0 if episode is None else episode.steps

    def record_outcome(self, bucket: int, tokens: int, seconds: float, steps: int, batch_size: int = 1,
                       prefill: bool = False, reopen_margin: float | None = None) -> bool:
        """Plain mode: the reference rate. Drafting: the episode, stopped once its recent
        steps are clearly below the reference, and judged as go_plain judges it: True where it
        won by reopen_margin all the same. A step that carried the drafter's prefill of a
        prompt is not part of it (policy.record_step)."""
        self.clock[bucket] = self.clock.get(bucket, 0.0) + seconds
        per_request = tokens / batch_size
        if bucket in self.plain:
            self.plain_rate[bucket] = self._plain_rates.add(bucket, per_request / seconds)
            return False
        if prefill:
            return False
        episode = self._episodes.setdefault(bucket, Episode())
        episode.add(per_request, seconds, batch_size)
        plain_rate = self.plain_rate.get(bucket)
        if (episode.steps >= GUARD_STEPS and plain_rate is not None
                and episode.recent_rate() < GUARD_RATIO * plain_rate):
            return self.go_plain(bucket, steps, reopen_margin)
        return False
