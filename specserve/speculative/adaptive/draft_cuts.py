"""DraftCut: which requests of a drafting step verify their drafts, and how many nodes.

A verify step is ragged (runner/tree_step.py: forward_ragged): it runs only the nodes it
verifies, so its cost follows the nodes of the requests that draft. The adaptive policy
(policy.py) cuts every draft to a tier and, where a class of requests is not expected to
gain enough tokens for its nodes, cuts that class's drafts to their root alone. Classes
are the drafter's evidence classes (NGRAM: the matched suffix's length) or, without them,
each request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, NamedTuple

if TYPE_CHECKING:
    from specserve.speculative.adaptive.acceptance import AcceptanceEvidence


@dataclass(frozen=True)
class DraftCut:
    tier: int                      # the most nodes a request's draft keeps (1: plain decoding)
    level: int                     # the level its step is priced at (AdaptiveDraftLength._level)
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


class DraftClasses:
    """The requests with a draft (more than a root), grouped by class: per class, how many
    requests have drafts of each node count (a few counts: a choice runs per step, and a
    loop over 64 requests per tier cost ~100 us of host time a step on the critical path)."""

    def __init__(self, rids: list[str], num_nodes: list[int], keys: list[int] | None):
        self.keys = keys is not None
        self._parts: dict[int, list[ClassPart]] = {}   # per tier: a choice reads them several times
        self.groups: dict[Hashable, dict[int, int]] = {}   # class -> {node count: requests}
        classes = keys if keys is not None else rids
        for cls, n in zip(classes, num_nodes):
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
            expected = evidence.expected_tokens("", tier, cls) if self.keys else evidence.expected_tokens(cls, tier)
            parts.append(ClassPart(cls, count * (expected - 1.0), extra))
        return parts


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
