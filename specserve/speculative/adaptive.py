"""Adaptive draft length: each step verifies the draft size (a "tier", 1 = plain decoding)
that maximises expected committed tokens per second of step time, at every batch size.

    tier* = argmax_t  sum_i E[tokens_i | t]  /  cost(batch bucket, t)

Both factors are measured, not assumed:

- cost: the wall time of whole steps (drafting, forward, verification, commit), an
  exponential moving average per (batch-size bucket, tier). Each tier is tried once per
  bucket (a few steps in a run); after that, one drafting step in REFRESH_EVERY
  re-measures the contender measured longest ago (tiers within REFRESH_MARGIN of the
  best), so a price taken during a one-off stall does not stick, and a tier far from
  winning is not paid for again.
- E[tokens_i | t]: a moving average over past proposals of how many tokens a proposal, cut
  to its first t nodes, would have committed: per evidence class when the drafter gives one
  (NGRAM: the length of the matched suffix, so that one-token matches, which rarely pay,
  are told apart from long ones), else per request; learned from "shadow" walks of the
  full proposals (acceptance.py).

Two modes per batch bucket, which starts plain. Drafting: every step proposes and picks its tier; a step that
picks 1 switches the bucket to plain. Plain: steps run on the overlapped plain path (the
next step queued before this one's tokens are read), and after the tokens are committed,
while the GPU runs the next step, the engine proposes for up to PROBE_REQUESTS requests of
the batch as shadows only (`probe`): no verify is paid for, yet the evidence keeps coming,
and the bucket switches back to drafting as soon as a tier above 1 is expected to win.

A probe is host time a plain step would not spend (the proposals, their shadows, and the
drafter's indexing of the tokens committed since the last probe, which plain steps leave
to the probes), and where a plain step is short that time is not hidden: on an H100 a
0.5B at batch 1 (plain steps ~0.9 ms) ran 0.70-0.79x of a plain engine in plain mode, and
on the CPU (bench/plain_step_host.py) probing and indexing on every plain step were
nearly all of the host time a plain step of the speculative engine added. So a bucket
probes every k-th plain step (`probe_due`), k the smallest that keeps the probes' measured
host time within PROBE_BUDGET of its plain step's measured cost (at most MAX_PROBE_EVERY).
The budget is 1%: what a probe step costs beyond its timed part (colder caches) measured
up to as much again.

The model above can be wrong (a class's history may not transfer to new text, a probe sees
a sample), so measured outcomes have the last word: the engine reports the tokens every
step committed, a bucket keeps the realized rate (tokens per second) of its plain steps,
and each drafting episode (from a switch to drafting until the next switch back) is
compared with it. An episode that falls below GUARD_RATIO of the plain rate after
GUARD_STEPS steps is stopped; an episode that lost doubles how long the bucket then stays
plain before probes may switch it again (PLAIN_HOLD .. MAX_PLAIN_HOLD steps); one that won
resets it. A probe's switch waits for the step already launched ahead to finish instead
of throwing it away.

Cutting a tree to its first t nodes keeps a valid tree (parents come before children),
and the tiers are sizes the CUDA graphs were captured for, so replay stays valid.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from specserve.speculative.acceptance import AcceptanceEvidence
from specserve.speculative.tree import TreeProposal

COST_EMA = 0.2       # step times are noisy
REFRESH_EVERY = 50
REFRESH_MARGIN = 0.8   # re-measure tiers expected to reach this fraction of the best rate
PROBE_REQUESTS = 16    # proposals per probe
PROBE_BUDGET = 0.01    # probes' timed host work may add this fraction to a plain step, on average
MAX_PROBE_EVERY = 32   # ... but a plain bucket is probed at least every this many steps
PROBE_COST_EMA = 0.3
# a plain bucket drafts again only when drafting is expected to beat plain by this much:
# a switch costs a step that is not launched ahead, and a probe sees only a sample, so
# without a margin the two modes can alternate step by step
SWITCH_MARGIN = 1.15
REALIZED_EMA = 0.1     # realized plain-mode rate: a smooth reference for the episodes
GUARD_STEPS = 8        # a drafting episode is judged on its realized rate after this many steps
GUARD_RATIO = 0.97     # ... and stopped below this fraction of the plain rate
PLAIN_HOLD = 16        # steps a bucket stays plain after a drafting episode that won (or its first)
MAX_PLAIN_HOLD = 1024  # after episodes that lost the hold doubles, up to this


@dataclass
class _Episode:
    """A bucket's drafting run since it last switched to drafting."""
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class AdaptiveDraftLength:
    def __init__(self, tiers: list[int]):
        self.tiers = sorted(set(tiers) | {1})
        self._cost: dict[tuple[int, int], float] = {}
        self._measured_at: dict[tuple[int, int], int] = {}  # the bucket's step count at the last measurement
        self._bucket_steps: dict[int, int] = {}
        self._plain: set[int] = set()                       # buckets in plain mode
        self._switching: dict[int, bool] = {}               # bucket -> a probe's switch waits (True: next step)
        self._hold: dict[int, int] = {}                     # bucket -> steps to stay plain after an episode
        self._plain_until: dict[int, int] = {}              # bucket -> step count before which probes wait
        self._plain_rate: dict[int, float] = {}             # bucket -> realized tokens/s of plain steps
        self._episodes: dict[int, _Episode] = {}            # bucket -> its current drafting episode
        self._probe_offset = 0                              # rotates the requests a probe drafts for
        self._probe_cost: dict[int, float] = {}             # bucket -> host seconds of a probe
        self._unprobed: dict[int, int] = {}                 # bucket -> plain steps since its last probe
        self._probe_every: dict[int, int] = {}              # bucket -> k, set when a probe is timed
        # the tier that prices a step whose largest tree has `size` nodes: _tier_of[size]
        self._tier_of = [next(t for t in self.tiers if t >= size) for size in range(self.tiers[-1] + 1)]
        self.evidence = AcceptanceEvidence(self.tiers)
        self.steps_per_tier = {t: 0 for t in self.tiers}

    # --- the choice ---
    def should_draft(self, batch_size: int) -> bool:
        """Whether this step drafts: False while its bucket is in plain mode. A switch a
        probe asked for takes effect the step after next (see would_draft)."""
        bucket = self._seen(batch_size)
        if bucket in self._switching:
            if not self._switching[bucket]:
                self._switching[bucket] = True   # this step still decodes plainly (e.g. one launched ahead)
                return False
            del self._switching[bucket]
            self._plain.discard(bucket)
            self._episodes[bucket] = _Episode()
        return bucket not in self._plain

    def would_draft(self, batch_size: int) -> bool:
        """Whether the step after this one may draft: no plain step is launched ahead then
        (a step launched ahead and not used is a GPU step thrown away)."""
        bucket = self._seen(batch_size)
        if bucket in self._switching:
            self._switching[bucket] = True
            return True
        return bucket not in self._plain

    def _seen(self, batch_size: int) -> int:
        """The batch size's bucket; a bucket seen for the first time starts plain, held for
        PLAIN_HOLD steps: its plain rate is the reference drafting must beat (at large
        batches a verify step costs several plain ones, and optimistic priors would
        otherwise draft first and learn later)."""
        bucket = _bucket(batch_size)
        if bucket not in self._hold:
            self._hold[bucket] = PLAIN_HOLD
            self._plain_until[bucket] = self._bucket_steps.get(bucket, 0) + PLAIN_HOLD
            self._plain.add(bucket)
        return bucket

    def probe_requests(self, batch_size: int) -> range:
        """Which requests of a plain step to propose for, as shadows (a rotating window)."""
        count = min(batch_size, PROBE_REQUESTS)
        start = self._probe_offset % batch_size
        self._probe_offset += count
        return range(start, start + count)

    def probe_due(self, batch_size: int, every_at_least: int = 1) -> bool:
        """Whether this plain step probes: every k-th plain step of its bucket (counted here),
        k the smallest that keeps the probes' host time within PROBE_BUDGET of the plain
        step's cost, never below `every_at_least` (a drafter whose proposals cost forwards)."""
        bucket = _bucket(batch_size)
        waited = self._unprobed.get(bucket, 0) + 1
        if waited < every_at_least or waited < self._probe_every.get(bucket, 1):
            self._unprobed[bucket] = waited
            return False
        self._unprobed[bucket] = 0
        return True

    def probe_every(self, batch_size: int) -> int:
        """k for the bucket: 1 until a probe and a plain step have been timed."""
        return self._probe_every.get(_bucket(batch_size), 1)

    def record_probe(self, batch_size: int, seconds: float) -> None:
        """The host time of a probe (its proposals, shadows and the indexing they needed);
        sets the bucket's k against its plain step's current cost."""
        bucket = _bucket(batch_size)
        old = self._probe_cost.get(bucket)
        probe = self._probe_cost[bucket] = seconds if old is None else old + PROBE_COST_EMA * (seconds - old)
        step = self._cost.get((bucket, 1))
        if step:
            self._probe_every[bucket] = min(MAX_PROBE_EVERY, max(1, math.ceil(probe / (PROBE_BUDGET * step))))

    def probe(self, batch_size: int, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> None:
        """After a plain step: the sampled requests' proposals (recorded as shadows) say
        whether drafting is expected to win now; if so the bucket drafts again."""
        bucket = _bucket(batch_size)
        if max(num_nodes) == 1 or bucket not in self._plain or bucket in self._switching:
            return
        if self._bucket_steps.get(bucket, 0) < self._plain_until.get(bucket, 0):
            return  # held plain after a drafting episode (the shadows still gather evidence)
        _, best, rates = self._best_tier(bucket, batch_size, rids, num_nodes, keys)
        if best > 1 and (not rates or rates[best] >= SWITCH_MARGIN * rates[1]):
            self._switching[bucket] = False

    def choose(self, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> int:
        """The tier to verify this drafting step, given each request's proposal size (and
        class); choosing 1 puts the bucket in plain mode."""
        bucket = _bucket(len(rids))
        if max(num_nodes) == 1:
            return 1  # nothing to verify: says nothing about whether drafting pays
        choice, best, _ = self._best_tier(bucket, len(rids), rids, num_nodes, keys, measure=True)
        if best == 1:  # not a re-measurement of tier 1: plain decoding is expected to win
            self._go_plain(bucket)
        return choice

    def _go_plain(self, bucket: int) -> None:
        """Ends the bucket's drafting episode; how long it now stays plain depends on
        whether the episode beat plain decoding's realized rate."""
        episode = self._episodes.pop(bucket, _Episode())
        plain_rate = self._plain_rate.get(bucket)
        hold = self._hold.get(bucket, PLAIN_HOLD)
        lost = plain_rate is not None and episode.rate() < plain_rate
        self._hold[bucket] = min(2 * hold, MAX_PLAIN_HOLD) if lost else PLAIN_HOLD
        self._plain_until[bucket] = self._bucket_steps.get(bucket, 0) + self._hold[bucket]
        self._plain.add(bucket)

    def _best_tier(self, bucket: int, batch_size: int, rids: list[str], num_nodes: list[int],
                   keys: list[int] | None, measure: bool = False) -> tuple[int, int, dict[int, float]]:
        """(the tier to run, the tier of the highest expected rate, the rates (tokens per
        second) of every useful tier). The tier to run is the best one, except that a tier
        not priced at this bucket yet (and, with `measure`, now and then the stalest
        contender) is run to be priced; while tiers are unpriced there are no rates."""
        tiers = self._useful_tiers(max(num_nodes))
        unpriced = [t for t in tiers if (bucket, t) not in self._cost]
        if unpriced:  # each tier is priced once per bucket, cheapest first
            return unpriced[0], unpriced[0], {}
        scale = batch_size / len(rids)   # a probe sees a sample of the batch
        rates = {t: scale * tokens / self._cost[(bucket, t)]
                 for t, tokens in self._expected_batch_tokens(tiers, rids, num_nodes, keys).items()}
        best = max(tiers, key=rates.get)
        steps = self._bucket_steps.get(bucket, 0)
        if measure and steps % REFRESH_EVERY == REFRESH_EVERY - 1:
            contenders = [t for t in tiers if rates[t] >= REFRESH_MARGIN * rates[best]]
            return min(contenders, key=lambda t: self._measured_at[(bucket, t)]), best, rates
        return best, best, rates

    def _expected_batch_tokens(self, tiers: list[int], rids: list[str], num_nodes: list[int],
                               keys: list[int] | None) -> dict[int, float]:
        """Per tier: the tokens the batch is expected to commit (1 for a request without a
        draft). With evidence classes, requests of one class expect the same: summed per
        class (a handful), not per request."""
        if keys is None:
            return {t: sum(self.expected_tokens(rid, t) if n > 1 else 1.0 for rid, n in zip(rids, num_nodes))
                    for t in tiers}
        per_class = Counter(key for key, n in zip(keys, num_nodes) if n > 1)
        undrafted = len(rids) - sum(per_class.values())
        return {t: undrafted + sum(count * self.evidence.expected_tokens("", t, key) for key, count in per_class.items())
                for t in tiers}

    def _useful_tiers(self, largest: int) -> list[int]:
        """Tiers up to the first that holds every proposal (larger ones run the same forward)."""
        useful = []
        for tier in self.tiers:
            useful.append(tier)
            if tier >= largest:
                break
        return useful

    def expected_tokens(self, rid: str, tier: int, key: int | None = None) -> float:
        """Tokens a step at this tier is expected to commit for the request (given a draft
        of evidence class `key`, when the drafter gives classes)."""
        return self.evidence.expected_tokens(rid, tier, key)

    # --- evidence ---
    def record_step(self, batch_size: int, tree_size: int, seconds: float, tokens: int | None = None) -> None:
        """A step whose largest tree had tree_size nodes: it is priced as the smallest tier
        that holds it (the forward a GPU graph runs for it). `tokens`: what it committed,
        for the realized rates of the bucket's modes."""
        tier = self._tier_of[tree_size] if tree_size < len(self._tier_of) else self.tiers[-1]
        bucket = _bucket(batch_size)
        key = (bucket, tier)
        old = self._cost.get(key)
        self._cost[key] = seconds if old is None else old + COST_EMA * (seconds - old)
        self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        self._measured_at[key] = self._bucket_steps[bucket]
        self.steps_per_tier[tier] += 1
        if tokens is not None and seconds > 0:
            self._record_outcome(bucket, tokens, seconds)

    def _record_outcome(self, bucket: int, tokens: int, seconds: float) -> None:
        """Plain mode: the reference rate. Drafting: the episode, stopped once it is
        clearly below the reference."""
        if bucket in self._plain:
            old = self._plain_rate.get(bucket)
            rate = tokens / seconds
            self._plain_rate[bucket] = rate if old is None else old + REALIZED_EMA * (rate - old)
            return
        episode = self._episodes.setdefault(bucket, _Episode())
        episode.tokens += tokens
        episode.seconds += seconds
        episode.steps += 1
        plain_rate = self._plain_rate.get(bucket)
        if episode.steps >= GUARD_STEPS and plain_rate is not None and episode.rate() < GUARD_RATIO * plain_rate:
            self._go_plain(bucket)

    def record_proposals(self, rids: list[str], trees: TreeProposal, num_nodes: list[int],
                         keys: list[int] | None = None) -> None:
        """Full proposals (before any cut, verified or probes), one shadow per real draft."""
        self.evidence.record(rids, trees, num_nodes, keys)

    def observe(self, rid: str, committed: list[int]) -> None:
        """Walks every pending proposal of `rid` down the tokens it just committed."""
        self.evidence.observe(rid, committed)

    def release(self, rid: str) -> None:
        self.evidence.release(rid)


def _bucket(batch_size: int) -> int:
    """Batch sizes grouped by powers of two: step cost grows smoothly with the batch."""
    return 1 << (batch_size - 1).bit_length()


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
