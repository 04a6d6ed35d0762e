"""StepCosts: the price of a step per (batch-size bucket, tier), measured, not assumed.

A price is the wall time of whole steps (drafting, forward, verification, commit), the
median of the last COST_WINDOW per (bucket, tier). Each tier is tried once per bucket (a
few steps in a run) where it could win at its `floor` price; after that, one drafting step
in REFRESH_EVERY re-measures the contender measured longest ago (the policy says which
tiers contend), so a price taken during a one-off stall does not stick, and a tier far
from winning is not paid for again.
A median, not a moving average: a tier a drafting bucket measures once in REFRESH_EVERY
steps kept an outlier for hundreds of steps (a CPU replay with H100-like step costs: plain
decoding priced at 92 ms a step, its steps taking 9.7 ms, from a plain step that waited
for the indexing of 64 new prompts).

Plain decoding is priced by what plain mode runs: steps launched one ahead (overlap.py)
that did not probe. A plain step run any other way (a re-measurement inside a drafting
episode, the step after one, a probe's host time) prices it only until such a step has
been seen: on an H100 (0.5B, ShareGPT second turns at 64) those steps took 3.2-4.4 ms where
overlapped ones took 1.5-2.0, so drafting looked 1.5x faster than plain at a batch where
it lost 27% end to end.

Drafting tiers likewise: a step launched when the scheduler asked for it (an episode's
first, and any after the batch changed) is priced as a makeshift until the tier has a
steady price, and one makeshift step neither rates the tier nor bounds another bucket's
floor (`rateable`): an EAGLE-3 episode's first step, its head catching up on the plain
stretch, took 4-8 ms at batch 4, where a chained step at batch 8 takes ~3 (H200, 1.5B),
and as a price it kept every bucket of those runs plain.
"""
from __future__ import annotations

import statistics
from collections import deque

COST_WINDOW = 5      # step times are noisy, and a stall is one step: the median of a few
REFRESH_EVERY = 50
MIN_SAMPLES = 3      # a price from fewer steps is provisional (stale)
STALE_AFTER = 512    # ... as is one taken more than this many of the bucket's steps ago
RECHECK_GAP = 128    # ... unless it was taken within this many
# A makeshift step within this factor of a tier's steady price confirms the price (see stale)
CONFIRM_BAND = 1.15


class RecentMedians:
    """Per key, the median of the last `window` values added: a measurement robust to the
    one slow step a stall or a wait for indexing makes (a moving average keeps it)."""

    def __init__(self, window: int):
        self.window = window
        self._recent: dict = {}

    def add(self, key, value: float) -> float:
        """Adds `value` under `key`; returns the key's median now."""
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(value)
        return statistics.median(recent)

    def clear(self, key) -> None:
        self._recent.pop(key, None)

    def count(self, key) -> int:
        return len(self._recent.get(key, ()))

    def values(self, key) -> tuple[float, ...]:
        """The key's last `window` values, oldest first."""
        return tuple(self._recent.get(key, ()))


class StepCosts:
    def __init__(self, tiers: list[int], cost_per_node: bool = False):
        """cost_per_node: a drafting step's added cost grows with its draft nodes (a CPU's
        compute-bound forward), so a larger tier's price floors a smaller one only in
        proportion to their nodes (see floor); False on a GPU, where the fixed part dominates."""
        self.tiers = tiers
        self.cost_per_node = cost_per_node
        self.seconds: dict[tuple[int, int], float] = {}      # (bucket, tier) -> a step's wall time
        self._recent = RecentMedians(COST_WINDOW)
        self.measured_at: dict[tuple[int, int], int] = {}    # the bucket's step count at the last measurement
        self._bucket_steps: dict[int, int] = {}
        self._steady: set[tuple[int, int]] = set()           # keys priced by steady steps (see the docstring)
        self._confirmations: dict[tuple[int, int], int] = {}  # key -> makeshift steps that confirmed its price
        # the tier that prices a step whose largest tree has `size` nodes: _tier_of[size]
        self._tier_of = [next(t for t in tiers if t >= size) for size in range(tiers[-1] + 1)]

    def record(self, bucket: int, tree_size: int, seconds: float, steady: bool = True) -> int:
        """A step whose largest tree had tree_size nodes: it is priced as the smallest tier
        that holds it (the forward a GPU graph runs for it). Returns that tier. `steady`:
        whether the step ran as its tier's mode runs its steps; once a key has a steady
        price, other steps only advance the bucket's clock."""
        tier = self._tier_of[tree_size] if tree_size < len(self._tier_of) else self.tiers[-1]
        key = (bucket, tier)
        self._bucket_steps[bucket] = self.steps(bucket) + 1
        if steady and key not in self._steady:   # the first steady step replaces the makeshift prices
            self._steady.add(key)
            self._recent.clear(key)
        if steady or key not in self._steady:
            self.seconds[key] = self._recent.add(key, seconds)
            self.measured_at[key] = self._bucket_steps[bucket]
        elif self.seconds[key] / CONFIRM_BAND <= seconds <= self.seconds[key] * CONFIRM_BAND:
            self._confirmations[key] = self._confirmations.get(key, 0) + 1
            self.measured_at[key] = self._bucket_steps[bucket]
        return tier

    def steps(self, bucket: int) -> int:
        """Steps of the bucket recorded so far: the clock that plain holds and refreshes count in."""
        return self._bucket_steps.get(bucket, 0)

    def steadily_priced(self, bucket: int, tier: int) -> bool:
        """Whether the tier's price at the bucket comes from steps run as its mode runs them."""
        return (bucket, tier) in self._steady

    def stale(self, bucket: int, tier: int) -> bool:
        """Whether the tier's price at the bucket rests on fewer than MIN_SAMPLES steps (a
        tier is tried once per bucket, often in a bucket's first, slowest steps) or was
        taken more than STALE_AFTER of its steps ago; either way not within the last
        RECHECK_GAP steps (a re-measurement that confirmed the price waits that long).
        A makeshift step that cost within CONFIRM_BAND of a steady price counts as a
        measurement of it: where the batch changes nearly every step, steady steps are rare,
        and a level priced by two of them stayed stale however often it ran; each RECHECK_GAP
        steps a probe switched its bucket to re-price it, whatever the switch margin said
        (H100, 1.5B, ShareGPT at 32: 11 of 13 switches a run, steps of 6.5-7.5 ms against a
        steady 6.7, at accept ~1.2)."""
        key = (bucket, tier)
        age = self.steps(bucket) - self.measured_at.get(key, 0)
        samples = self._recent.count(key) + self._confirmations.get(key, 0)
        return age >= RECHECK_GAP and (samples < MIN_SAMPLES or age > STALE_AFTER)

    def unpriced(self, bucket: int, tiers: list[int]) -> list[int]:
        """The tiers a choice cannot rate yet (see rateable)."""
        return [t for t in tiers if not self.rateable(bucket, t)]

    def rateable(self, bucket: int, tier: int) -> bool:
        """Whether a choice may rate the tier by its price: plain decoding once priced at all
        (BucketModes.plain_trial sees to a steady price), a drafting tier once priced by a
        steady step or by MIN_SAMPLES makeshift ones (where no step runs as drafting mode
        runs them: a batch that turns over every step). One makeshift step is no price to
        choose by: an episode's first step paid for its proposal, a model drafter's for the
        catch-up of the plain stretch too (engine/drafting_steps.py)."""
        key = (bucket, tier)
        if key not in self.seconds:
            return False
        return tier == 1 or key in self._steady or self._recent.count(key) >= MIN_SAMPLES

    def price(self, bucket: int, tier: int) -> float | None:
        """The tier's price at the bucket where a choice may rate it (see rateable), else its floor."""
        return self.seconds[(bucket, tier)] if self.rateable(bucket, tier) else self.floor(bucket, tier)

    def refresh_due(self, bucket: int) -> bool:
        """Whether this drafting step of the bucket re-measures a contender."""
        return self.steps(bucket) % REFRESH_EVERY == REFRESH_EVERY - 1

    def floor(self, bucket: int, tier: int) -> float | None:
        """A lower bound on the price of an unpriced tier at the bucket (None while plain
        decoding is unpriced there): plain decoding's price plus the least a drafting step
        is known to add to it. What drafting adds grows with the tier and the batch but
        less than in proportion to the batch (a fixed part: proposing, building the tree,
        verifying), so a priced tier t' <= t at a bucket b' adds at least what it adds at
        b' <= b, and at least (b / 2) / b' of it at b' > b (bucket b runs batches above
        b / 2). Only rateable prices bound it (one makeshift step is no lower bound).
        Nor does it fall below the least any drafting step adds at a bucket b' <= b, of any
        tier: its fixed part. Without it a tier no bucket had priced (a ragged step's level 2)
        was floored at plain's price, and each bucket a batch passed through priced it by
        drafting steps that lost (H200, 1.5B, ShareGPT multi-turn at 32/64: ~60% of the
        drafting steps were such, 3.6-4 ms where plain took 2, at accept ~1.2).
        With cost_per_node (a CPU), what a larger tier t' adds bounds a smaller one's fixed
        part only in proportion to their draft nodes, (t - 1) / (t' - 1): a step that adds a
        fixed part and a part per node adds at least that much. On a CPU the part per node
        is most of it (SmolLM2-135M, busy 2 cores: 16 nodes ~4x a plain step); taken whole,
        a 16-node step's price floored levels 2-8 at the same ~4x, so none was ever tried,
        and a batch-1 JSON edit whose 4-node drafts pay stayed plain. On a GPU a step's
        weights cost the same for 2 or 16 nodes, and the whole fixed part is the bound.
        A larger tier t' priced at a bucket b' >= b bounds a smaller one on either device in
        proportion to the draft rows each verifies, b (t - 1) against b' (t' - 1) (b / 2 where
        b' > b): what a step adds, a fixed part and a part per row, is at least that share of
        the larger step's. At large batches the rows dominate: on an H100 (1.5B, ShareGPT at 64)
        tier 16 added 8.8 ms, 8 5.1 and 4 3.1 (this bound: 4.1 and 1.8), and with smaller
        buckets' prices as their floors tiers 8 and 4 were each priced there by an episode
        of their own, at chat's accept of ~1.1."""
        plain = self.seconds.get((bucket, 1))
        if plain is None:
            return None
        added, fixed = 0.0, None
        for (other, tier_priced), seconds in self.seconds.items():
            base = self.seconds.get((other, 1))
            # rateable prices only: one makeshift step may cost several steady ones (an episode's first)
            if tier_priced == 1 or base is None or not self.rateable(other, tier_priced):
                continue
            if tier_priced <= tier:
                share = 1.0 if other <= bucket else bucket / 2 / other
            elif other >= bucket:   # a larger tier: in proportion to the draft rows each verifies
                rows = bucket if other == bucket else bucket / 2
                share = rows * (tier - 1) / (other * (tier_priced - 1))
            else:
                share = 0.0
            added = max(added, share * (seconds - base))
            if other <= bucket:
                node_share = min(1.0, (tier - 1) / (tier_priced - 1)) if self.cost_per_node else 1.0
                least = (seconds - base) * node_share
                fixed = least if fixed is None else min(fixed, least)
        return plain + max(added, fixed or 0.0)


def batch_bucket(batch_size: int) -> int:
    """Batch sizes grouped by powers of two: step cost grows smoothly with the batch."""
    return 1 << (batch_size - 1).bit_length()
