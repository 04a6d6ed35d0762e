"""Adaptive draft length: each step verifies the draft size (a "tier", 1 = plain decoding)
that maximises expected committed tokens per second of step time.

    tier* = argmax_t  sum_i E[tokens_i | t]  /  cost(batch bucket, t)

Both factors are measured, not assumed:

- cost: the wall time of whole steps (drafting, forward, verification, commit), an
  exponential moving average per (batch-size bucket, tier). The first steps at a bucket
  try each useful tier once; after that, one step in REFRESH_EVERY re-measures the tier
  measured longest ago, so a price taken during a one-off stall does not stick.
- E[tokens_i | t]: a moving average over past proposals of how many tokens a proposal, cut
  to its first t nodes, would have committed: per evidence class when the drafter gives one
  (NGRAM: the length of the matched suffix, so that one-token matches, which rarely pay,
  are told apart from long ones), else per request. The drafter always
  proposes the full tree and only the verified part is cut, so this is known for every
  tier, including tiers larger than the one verified: a "shadow" walk follows the tokens
  the request commits over the next steps down the full proposal. In greedy decoding the
  committed stream does not depend on the drafts, so the counterfactual is exact.

Drafting itself costs host time (a trie walk per request), so while a batch bucket of
PROBE_MIN_BATCH requests or more decodes plainly, only one step in PROBE_EVERY drafts at
all: enough to notice when drafts start to pay, without paying for drafts thrown away.
Smaller batches draft every step and decide per step, from each proposal's class.

Cutting a tree to its first t nodes keeps a valid tree (parents come before children),
and the tiers are sizes the CUDA graphs were captured for, so replay stays valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.speculative.tree import TreeProposal

COST_EMA = 0.2       # step times are noisy; tokens per proposal change with the text
ACCEPT_EMA = 0.3
REFRESH_EVERY = 50
PROBE_EVERY = 8
PROBE_MIN_BATCH = 8


@dataclass
class _Shadow:
    """One past proposal being walked down by the tokens committed since."""
    children: dict[tuple[int, int], int]   # (parent node, token) -> node
    key: int | None                        # the drafter's evidence class, if any
    node: int = 0                          # deepest node matched so far
    path: list[int] = field(default_factory=list)  # matched nodes below the root


class AdaptiveDraftLength:
    def __init__(self, tiers: list[int]):
        self.tiers = sorted(set(tiers) | {1})
        self._cost: dict[tuple[int, int], float] = {}
        self._measured_at: dict[tuple[int, int], int] = {}  # the bucket's step count at the last measurement
        self._bucket_steps: dict[int, int] = {}
        self._last_choice: dict[int, int] = {}              # bucket -> tier of its last drafted step
        self._plain_streak: dict[int, int] = {}             # bucket -> steps since it last drafted
        self._prior = {t: float(t) for t in self.tiers}  # before any evidence: every draft node accepted
        self._expected: dict[str, dict[int, float]] = {}    # per request
        self._by_key: dict[int, dict[int, float]] = {}      # per evidence class
        self._shadows: dict[str, list[_Shadow]] = {}
        self.steps_per_tier = {t: 0 for t in self.tiers}

    # --- the choice ---
    def should_draft(self, batch_size: int) -> bool:
        """False while plain decoding wins at this batch size, except for one probe step in
        PROBE_EVERY (drafting costs host time even when nothing is verified)."""
        bucket = _bucket(batch_size)
        if bucket < PROBE_MIN_BATCH or self._last_choice.get(bucket, 0) != 1:
            return True
        streak = self._plain_streak.get(bucket, 0) + 1
        self._plain_streak[bucket] = 0 if streak >= PROBE_EVERY else streak
        return streak >= PROBE_EVERY

    def would_draft(self, batch_size: int) -> bool:
        """What the next should_draft(batch_size) will answer, without counting a step."""
        bucket = _bucket(batch_size)
        return (bucket < PROBE_MIN_BATCH or self._last_choice.get(bucket, 0) != 1
                or self._plain_streak.get(bucket, 0) + 1 >= PROBE_EVERY)

    def choose(self, rids: list[str], num_nodes: list[int], keys: list[int] | None = None) -> int:
        """The tier to verify this step, given each request's proposal size (and class)."""
        bucket = _bucket(len(rids))
        tiers = self._useful_tiers(max(num_nodes))
        choice = self._tier_to_measure(bucket, tiers)
        if choice is None:
            def rate(tier: int) -> float:
                tokens = sum(self.expected_tokens(rid, tier, key) if n > 1 else 1.0
                             for rid, n, key in zip(rids, num_nodes, keys or [None] * len(rids)))
                return tokens / self._cost[(bucket, tier)]
            choice = max(tiers, key=rate)
        if max(num_nodes) > 1:  # a step without drafts says nothing about whether drafting pays
            self._last_choice[bucket] = choice
        return choice

    def _useful_tiers(self, largest: int) -> list[int]:
        """Tiers up to the first that holds every proposal (larger ones run the same forward)."""
        useful = []
        for tier in self.tiers:
            useful.append(tier)
            if tier >= largest:
                break
        return useful

    def _tier_to_measure(self, bucket: int, tiers: list[int]) -> int | None:
        unmeasured = [t for t in tiers if (bucket, t) not in self._cost]
        if unmeasured:
            return unmeasured[0]
        steps = self._bucket_steps.get(bucket, 0)
        if len(tiers) > 1 and steps % REFRESH_EVERY == REFRESH_EVERY - 1:
            return min(tiers, key=lambda t: self._measured_at[(bucket, t)])
        return None

    def expected_tokens(self, rid: str, tier: int, key: int | None = None) -> float:
        """Tokens a step at this tier is expected to commit for the request (given a draft
        of evidence class `key`, when the drafter gives classes)."""
        if key is not None:
            return self._by_key.get(key, self._prior)[tier]
        return self._expected.get(rid, self._prior)[tier]

    # --- evidence ---
    def record_step(self, batch_size: int, tree_size: int, seconds: float) -> None:
        """A step whose largest tree had tree_size nodes: it is priced as the smallest tier
        that holds it (the forward a GPU graph runs for it)."""
        tier = next((t for t in self.tiers if t >= tree_size), self.tiers[-1])
        bucket = _bucket(batch_size)
        key = (bucket, tier)
        old = self._cost.get(key)
        self._cost[key] = seconds if old is None else old + COST_EMA * (seconds - old)
        self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        self._measured_at[key] = self._bucket_steps[bucket]
        self.steps_per_tier[tier] += 1

    def record_proposals(self, rids: list[str], trees: TreeProposal, num_nodes: list[int],
                         keys: list[int] | None = None) -> None:
        """The full proposals of this step (before any cut), one shadow per real draft."""
        tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
        for row, (rid, count) in enumerate(zip(rids, num_nodes)):
            if count > 1:
                children = {(parents[row][i], tokens[row][i]): i for i in range(1, count)}
                self._shadows.setdefault(rid, []).append(_Shadow(children, keys[row] if keys else None))

    def observe(self, rid: str, committed: list[int]) -> None:
        """Walks every pending proposal of `rid` down the tokens it just committed."""
        shadows = self._shadows.get(rid)
        if not shadows:
            return
        pending = []
        for shadow in shadows:
            if self._walk(shadow, committed):
                pending.append(shadow)
            else:
                self._resolve(rid, shadow)
        self._shadows[rid] = pending

    def release(self, rid: str) -> None:
        self._shadows.pop(rid, None)
        self._expected.pop(rid, None)

    @staticmethod
    def _walk(shadow: _Shadow, committed: list[int]) -> bool:
        """Follows committed tokens down the tree; False once the walk has ended."""
        for token in committed:
            child = shadow.children.get((shadow.node, token))
            if child is None:
                return False
            shadow.node = child
            shadow.path.append(child)
        return any(parent == shadow.node for parent, _ in shadow.children)

    def _resolve(self, rid: str, shadow: _Shadow) -> None:
        """Tokens the proposal cut to t nodes would have committed: the accepted path runs
        through increasing node indices, so it is the matched nodes below t, plus the bonus."""
        outcome = {t: 1.0 + sum(1 for node in shadow.path if node < t) for t in self.tiers}
        # the estimate `expected_tokens` reads for such a proposal: its class's, else its request's
        if shadow.key is not None:
            expected = self._by_key.setdefault(shadow.key, dict(self._prior))
        else:
            expected = self._expected.setdefault(rid, dict(self._prior))
        for t, tokens in outcome.items():
            expected[t] += ACCEPT_EMA * (tokens - expected[t])
            self._prior[t] += ACCEPT_EMA * ACCEPT_EMA * (tokens - self._prior[t])


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
