"""DraftCut: which requests of a drafting step verify their drafts, and how many nodes.

A verify step is ragged (runner/tree_step.py: forward_ragged): it runs only the nodes it
verifies, so its cost follows the nodes of the requests that draft. The adaptive policy
(policy.py) cuts every draft to a tier and, where a class of requests is not expected to
gain enough tokens for its nodes, cuts that class's drafts to their root alone. Classes
are the drafter's evidence classes (NGRAM: the matched suffix's length) or, without them
(no keys, or a key None: the hybrid's head drafts), each request.
TierCuts makes a choice's cuts: per tier, the cut a step at a bucket verifies and the
tokens a second it is expected to make (acceptance.py's evidence over costs.py's prices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, NamedTuple

from specserve.verify.tree import smallest_level

if TYPE_CHECKING:
    from specserve.speculative.adaptive.acceptance import AcceptanceEvidence
    from specserve.speculative.adaptive.costs import StepCosts

REFRESH_MARGIN = 0.8   # re-measure tiers expected to reach this fraction of the best rate


@dataclass(frozen=True)
class DraftCut:
    tier: int                      # the most nodes a request's draft keeps (1: plain decoding)
    level: int                     # the level its step is priced at (TierCuts.level)
    tokens: float                  # the tokens the batch is expected to commit
    drafted: frozenset | None      # the classes whose drafts are verified; None: every class

    def drafts(self, cls: Hashable) -> bool:
        return self.drafted is None or cls in self.drafted


PLAIN = DraftCut(1, 1, 0.0, frozenset())


class ClassPart(NamedTuple):
    """What one class's drafts add to a step at a tier, over verifying their roots alone (a
    tuple: a choice makes dozens a step, and a frozen dataclass costs ~1 us each)."""
    cls: Hashable
    gain: float    # expected committed tokens beyond one a request
    extra: int     # nodes beyond the root


def draft_classes(rids: list[str], keys: list[int | None] | None) -> list[Hashable]:
    """Each request's class: its evidence class (an int), or where it has none its id (a
    str): its own evidence (AcceptanceEvidence.expected_tokens by request)."""
    if keys is None:
        return rids
    return [rid if key is None else key for rid, key in zip(rids, keys)]


class DraftClasses:
    """The requests with a draft (more than a root), grouped by class: per class, how many
    requests have drafts of each node count (a few counts: a choice runs per step, and a
    loop over 64 requests per tier cost ~100 us of host time a step on the critical path)."""

    def __init__(self, rids: list[str], num_nodes: list[int], keys: list[int | None] | None):
        self._parts: dict[int, list[ClassPart]] = {}   # per tier: a choice reads them several times
        self.groups: dict[Hashable, dict[int, int]] = {}   # class -> {node count: requests}
        for cls, n in zip(draft_classes(rids, keys), num_nodes):
            if n > 1:
                sizes = self.groups.get(cls)
                if sizes is None:
                    sizes = self.groups[cls] = {}
                sizes[n] = sizes.get(n, 0) + 1

    def at_tier(self, tier: int, evidence: AcceptanceEvidence) -> list[ClassPart]:
        """Each class's gain and extra nodes with its drafts cut to `tier` nodes."""
        if tier in self._parts:
            return self._parts[tier]
        parts = self._parts[tier] = []
        for cls, sizes in self.groups.items():
            count = extra = 0
            for n, requests in sizes.items():
                count += requests
                extra += requests * (min(n, tier) - 1)
            expected = evidence.expected_tokens(cls, tier) if isinstance(cls, str) else evidence.expected_tokens("", tier, cls)
            parts.append(ClassPart(cls, count * (expected - 1.0), extra))
        return parts


class TierCuts:
    def __init__(self, tiers: list[int], ragged: bool, costs: StepCosts, evidence: AcceptanceEvidence):
        self.tiers, self.ragged, self.costs, self.evidence = tiers, ragged, costs, evidence

    def best(self, bucket: int, batch_size: int, rids: list[str], num_nodes: list[int], keys: list[int] | None,
             measure: bool = False) -> tuple[DraftCut, DraftCut, dict[int, float], dict[int, DraftCut]]:
        """(the cut to run, the cut of the highest expected rate, the rates (tokens per
        second) of every useful tier's cut, those cuts). The cut to run is the best one, except that a
        tier not priced at this bucket yet (and, with `measure`, now and then the stalest
        contender) is run to be priced; while tiers are unpriced there are no rates. A
        ragged policy prices levels as it goes: an unpriced level is rated at its floor
        (StepCosts.floor), so the cuts that may win at it run and price it, rather than every
        level in turn by whole drafts (at 64 requests, 16-node drafts: ~11 ms a step on an
        H200, 1.5B, where plain takes 2.3)."""
        tiers = self.useful(max(num_nodes))
        classes = DraftClasses(rids, num_nodes, keys)
        if self.ragged:
            cuts = self.at_tiers(bucket, classes, len(rids), tiers)
            if not self.costs.rateable(bucket, 1):   # what drafting must beat: priced first
                return cuts[1], cuts[1], {}, cuts
        else:
            cuts = self.at_tiers(bucket, classes, len(rids), tiers, whole=True)
            unpriced = self.costs.unpriced(bucket, tiers)
            if unpriced:  # each tier is priced once per bucket, cheapest first
                return cuts[unpriced[0]], cuts[unpriced[0]], {}, cuts
        scale = batch_size / len(rids)   # a probe sees a sample of the batch
        rates = {t: scale * cut.tokens / self.costs.price(bucket, cut.level) for t, cut in cuts.items()}
        best = max(tiers, key=rates.get)
        if measure and self.costs.refresh_due(bucket):
            # plain decoding always contends: it is what drafting must beat, and a price taken
            # in a slow step would otherwise stand while the bucket drafts (a CPU replay with
            # H100-like costs: tier 1 priced at 41 ms a step, 5x its real cost)
            contenders = [t for t in tiers if t == 1 or rates[t] >= REFRESH_MARGIN * rates[best]]
            stalest = min(contenders, key=lambda t: self.costs.measured_at.get((bucket, cuts[t].level), -1))
            return cuts[stalest], cuts[best], rates, cuts
        return cuts[best], cuts[best], rates, cuts

    def may_pay(self, bucket: int, rids: list[str], num_nodes: list[int], keys: list[int] | None,
                margin: float) -> bool:
        """Whether some tier may beat plain decoding by `margin` at the bucket, its unpriced
        levels at their floor price (StepCosts.floor): if none may, pricing them is drafting
        steps that lose. Without this, each bucket a draining batch passes through was
        priced by drafting whatever the evidence said (H200, 1.5B, ShareGPT second turns at
        32: ~40% of a run's drafting steps, at buckets 8 and 16, accept ~1.1-1.3)."""
        cuts = self.at_tiers(bucket, DraftClasses(rids, num_nodes, keys), len(rids), self.useful(max(num_nodes)))
        prices = {t: self.costs.price(bucket, cut.level) for t, cut in cuts.items()}
        if any(price is None for price in prices.values()):
            return True   # plain decoding is unpriced here: nothing bounds what drafting costs
        return any(cuts[t].tokens / prices[t] >= margin * cuts[1].tokens / prices[1] for t in cuts if t > 1)

    def at_tiers(self, bucket: int, classes: DraftClasses, requests: int, tiers: list[int],
                 whole: bool = False) -> dict[int, DraftCut]:
        """Per tier, the cut a step of `requests` at it verifies: every draft cut to the tier
        (`whole`, or a policy that is not ragged), else the classes whose drafts pay for
        their nodes (_ragged_cut)."""
        cuts = {}
        for tier in tiers:
            parts = classes.at_tier(tier, self.evidence) if tier > 1 else []
            if whole or not self.ragged or tier == 1:
                tokens = requests + sum(part.gain for part in parts)
                nodes = requests + sum(part.extra for part in parts)
                cuts[tier] = DraftCut(tier, self.level(tier, requests, nodes), tokens, None)
            else:
                cuts[tier] = self._ragged_cut(bucket, tier, requests, parts)
        return cuts

    def _ragged_cut(self, bucket: int, tier: int, requests: int, parts: list[ClassPart]) -> DraftCut:
        """The best cut at the tier: the classes that gain most tokens per node draft, as many
        as give the highest rate at their level's price (or its floor), the others verify
        their root alone. Cutting a weak class saves its nodes: at 64 requests a step of 8
        nodes each costs ~2.5x a plain one on an H200 (1.5B), one where a few draft about 1x."""
        parts = sorted(parts, key=lambda part: part.gain / max(part.extra, 1), reverse=True)
        prices: dict[int, float | None] = {}   # per level (a floor walks every price the policy holds)
        best, best_rate = (0, 1, float(requests)), -1.0     # (classes drafting, level, tokens)
        tokens = nodes = float(requests)
        for j, part in enumerate(parts):
            tokens, nodes = tokens + part.gain, nodes + part.extra
            level = self.level(tier, requests, nodes)
            if level not in prices:
                prices[level] = self.costs.price(bucket, level)
            rate = tokens / prices[level] if prices[level] else 0.0
            if rate > best_rate:
                best, best_rate = (j + 1, level, tokens), rate
        drafting, level, tokens = best
        return DraftCut(tier, level, tokens, frozenset(part.cls for part in parts[:drafting]))

    def level(self, tier: int, requests: int, nodes: float) -> int:
        """The level a step of `nodes` verified nodes over `requests` is priced at: its tier,
        or for a ragged policy the smallest tier holding its nodes per request."""
        return smallest_level(self.tiers, requests, nodes) if self.ragged else tier

    def useful(self, largest: int) -> list[int]:
        """Tiers up to the first that holds every proposal (larger ones run the same forward)."""
        useful = []
        for tier in self.tiers:
            useful.append(tier)
            if tier >= largest:
                break
        return useful


def fit_to_free_slots(num_nodes: list[int], free: int) -> list[int]:
    """Each request's nodes cut so that the step takes at most `free` KV slots: every root
    first (the scheduler keeps one slot a request), then an even share of what is left to
    each request that drafts (the first ones take the remainder). Cutting every draft to its
    root instead, when the pool was nearly full (admission fills it), left a small pool's
    requests decoding one token a step."""
    if sum(num_nodes) <= free:
        return list(num_nodes)
    drafting = [i for i, nodes in enumerate(num_nodes) if nodes > 1]
    share, remainder = divmod(max(free - len(num_nodes), 0), max(len(drafting), 1))
    fitted = [1] * len(num_nodes)
    for rank, i in enumerate(drafting):
        fitted[i] = min(num_nodes[i], 1 + share + (rank < remainder))
    return fitted
